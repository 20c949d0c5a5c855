"""What comes back after a restart besides the bytes: mode, owner and mtime
of files, directories and symlinks, exactly; and what the store shows of
them (a local store never more open than the mount)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tests.mountutil import run_cli, start_mount, stop_mount


def attrs(root) -> dict[str, tuple[int, int, int, int]]:
    """path -> (mode, uid, gid, mtime_ns) of everything under `root`, the root included."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in ["", *dirnames, *filenames]:
            p = os.path.join(dirpath, name) if name else dirpath
            if name == "" and dirpath != str(root):
                continue
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns)
    return out


def test_modes_owners_and_mtimes_come_back_exactly(tmp_path):
    m = start_mount(tmp_path)
    mp = m.mountpoint
    try:
        (mp / "run").mkdir()
        (mp / "run" / "checkpoint-25").mkdir()
        (mp / "run" / "checkpoint-25" / "model.pt").write_bytes(b"25")
        (mp / "run" / "checkpoint-30").mkdir()
        (mp / "run" / "checkpoint-30" / "model.pt").write_bytes(b"30")
        (mp / "shared").mkdir()
        os.chmod(mp / "shared", 0o1777)  # sticky, world-writable
        (mp / "private").mkdir(mode=0o700)
        (mp / "private" / "secret").write_bytes(b"s")
        os.chmod(mp / "private" / "secret", 0o600)
        (mp / "theirs").write_bytes(b"t")
        os.chown(mp / "theirs", 1234, 5678)
        (mp / "tool").write_bytes(b"#!/bin/sh\n")
        os.chown(mp / "tool", 4321, 4321)
        os.chmod(mp / "tool", 0o4755)  # setuid to its owner, who comes back with it
        os.symlink("run/checkpoint-30", mp / "latest")
        os.chown(mp / "latest", 1234, 1234, follow_symlinks=False)
        os.utime(mp / "run" / "checkpoint-25", ns=(1_000_000_000, 1_700_000_000_123_456_789))
        os.utime(mp / "theirs", ns=(1, 1_600_000_000_000_000_001))
        os.utime(mp / "latest", ns=(1, 1_650_000_000_000_000_000), follow_symlinks=False)
        # 1970 itself (reproducible builds: SOURCE_DATE_EPOCH=0) and before it: a time of 0 came back as the restart's
        (mp / "epoch").write_bytes(b"e")
        os.utime(mp / "epoch", ns=(0, 0))
        (mp / "before-1970").write_bytes(b"b")
        os.utime(mp / "before-1970", ns=(0, -86_400_000_000_123))
        (mp / "epoch-dir").mkdir()
        os.utime(mp / "epoch-dir", ns=(0, 0))
        os.symlink("epoch", mp / "epoch-link")
        os.utime(mp / "epoch-link", ns=(0, 0), follow_symlinks=False)
        os.chown(mp / "run", 1000, 1000)
        os.utime(mp / "run", ns=(1, 1_690_000_000_000_000_000))  # last: later entries would change it
        before = attrs(mp)
        assert run_cli("umount", str(mp)).returncode == 0
    finally:
        stop_mount(m)
    m = start_mount(tmp_path)
    try:
        after = attrs(m.mountpoint)
        assert after == before, {k: (before.get(k), after.get(k)) for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        # the store is never more open than the mount: a secret stays private there too
        store = m.store
        assert stat.S_IMODE(os.stat(store / "private" / "secret").st_mode) == 0o600
        assert stat.S_IMODE(os.stat(store / "private").st_mode) == 0o700
        assert stat.S_IMODE(os.stat(store / "shared").st_mode) == 0o1777
        assert stat.S_IMODE(os.stat(store / "tool").st_mode) == 0o755  # no set-ID bits in the store
    finally:
        stop_mount(m)


def test_files_another_tool_put_in_a_local_store_keep_its_modes_owners_and_times(tmp_path):
    """A store directory filled before ckptfs (`rsync -a`, `cp -a`) or beside
    it: with no record of them, the mount shows what the store's file system
    says, and never opens to every user (a root mount is `allow_other`) what
    the store keeps to one."""
    store = tmp_path / "store"
    (store / "private").mkdir(parents=True)
    (store / "private" / "token").write_bytes(b"secret\n")
    os.chmod(store / "private" / "token", 0o600)
    os.chown(store / "private" / "token", 1234, 5678)
    os.utime(store / "private" / "token", ns=(1, 1_600_000_000_123_456_789))
    os.chmod(store / "private", 0o700)
    os.chown(store / "private", 1234, 5678)
    (store / "tool").write_bytes(b"#!/bin/sh\n")
    os.chown(store / "tool", 1234, 1234)
    os.chmod(store / "tool", 0o4755)  # set-user-ID in a store ckptfs never wrote: not to be trusted
    (store / "shared").mkdir()
    os.chmod(store / "shared", 0o1777)
    os.chown(store / "shared", 1234, 1234)
    (store / "unrecorded").mkdir(mode=0o700)  # as a daemon killed before it recorded a directory it made leaves it
    (store / "unrecorded" / "model.pt").write_bytes(b"m")
    (store / "checkpoint-30").mkdir()
    (store / "checkpoint-30" / "model.pt").write_bytes(b"30")
    os.utime(store / "checkpoint-30" / "model.pt", ns=(1, 1_700_000_000_000_000_000))
    m = start_mount(tmp_path)
    mp = m.mountpoint
    try:
        st = os.stat(mp / "private" / "token")
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns) == (0o600, 1234, 5678, 1_600_000_000_123_456_789)
        st = os.stat(mp / "private")
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o700, 1234, 5678)
        st = os.stat(mp / "tool")
        assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o755, 1234)
        assert stat.S_IMODE(os.stat(mp / "shared").st_mode) == 0o1777
        assert stat.S_IMODE(os.stat(mp / "unrecorded").st_mode) == 0o755  # the defaults, as before: maybe ckptfs's own
        assert os.stat(mp / "checkpoint-30" / "model.pt").st_mtime_ns == 1_700_000_000_000_000_000
        import subprocess

        r = subprocess.run(["cat", str(mp / "private" / "token")], capture_output=True, user=65534)
        assert r.returncode != 0 and r.stdout == b"", r
        assert (mp / "private" / "token").read_bytes() == b"secret\n"  # its owner (here root) still reads it
    finally:
        stop_mount(m)


def test_the_mount_roots_mode_and_owner_come_back(tmp_path):
    """`chmod 700` and `chown` of the mount point itself, nothing else
    changed: a remount brought the root back 0755 and root's."""
    m = start_mount(tmp_path)
    try:
        (m.mountpoint / "f").write_bytes(b"x")
        assert run_cli("flush", str(m.mountpoint), "--timeout", "60").returncode == 0
        os.chmod(m.mountpoint, 0o700)
        os.chown(m.mountpoint, 1234, 5678)
        stop_mount(m)
        m = start_mount(tmp_path)
        st = os.stat(m.mountpoint)
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o700, 1234, 5678)
    finally:
        stop_mount(m)


def test_a_mode_changed_after_publication_reaches_the_store(fresh_mount):
    m = fresh_mount
    p = m.path("weights.bin")
    p.write_bytes(b"w" * 1000)
    assert run_cli("flush", str(m.mountpoint), "--timeout", "60").returncode == 0
    os.chmod(p, 0o600)
    (m.mountpoint / "d").mkdir()
    os.chmod(m.mountpoint / "d", 0o750)
    assert run_cli("flush", str(m.mountpoint), "--timeout", "60").returncode == 0
    assert stat.S_IMODE(os.stat(m.store / "weights.bin").st_mode) == 0o600
    deadline_ok = False
    for _ in range(100):  # directory attributes are recorded when the queue is idle
        if stat.S_IMODE(os.stat(m.store / "d").st_mode) == 0o750:
            deadline_ok = True
            break
        import time

        time.sleep(0.05)
    assert deadline_ok


def test_the_daemons_user_can_always_read_its_store_files_and_use_its_directories(tmp_path):
    """A write-only file and a read-only directory in the mount: in a local
    store the file stays readable by its owner, the daemon's user, and the
    directory usable (a daemon not run as root loaded such a file after a
    restart, for an append the mount allows, and met EACCES); never more
    open to anyone else; the mount shows the modes exactly after a restart."""
    import shutil
    import subprocess
    import sys
    import tempfile

    m = start_mount(tmp_path)
    mp = m.mountpoint
    try:
        (mp / "d").mkdir()
        for name, mode in (("w", 0o200), ("r", 0o444), ("g", 0o640)):
            (mp / "d" / name).write_bytes(name.encode())
            os.chmod(mp / "d" / name, mode)
        os.chmod(mp / "d", 0o500)
        assert run_cli("flush", str(mp), "--timeout", "60").returncode == 0  # directories' attributes too
        assert {n: stat.S_IMODE(os.stat(m.store / "d" / n).st_mode) for n in "wrg"} == {"w": 0o600, "r": 0o444, "g": 0o640}
        assert stat.S_IMODE(os.stat(m.store / "d").st_mode) == 0o700
        stop_mount(m)
        m = start_mount(tmp_path)
        assert {n: stat.S_IMODE(os.stat(m.mountpoint / "d" / n).st_mode) for n in "wrg"} == {"w": 0o200, "r": 0o444, "g": 0o640}
        assert stat.S_IMODE(os.stat(m.mountpoint / "d").st_mode) == 0o500
    finally:
        stop_mount(m)

    # What it is for: a daemon's user that is not root reads its write-only
    # file back, and publishes into its read-only directory.
    root = tempfile.mkdtemp(prefix="ckptfs-owner-")  # nobody must reach it: not under the test's 0700 tmp_path
    try:
        os.chmod(root, 0o755)
        os.chown(root, 65534, 65534)
        code = ("from ckptfs.writeback.localstore import LocalBackend; "
                f"b = LocalBackend({root!r}, 'file://' + {root!r}); "
                "b.publish(b.stage([b'secret'], 6), 'd/w', mode=0o200); b.chmod('d', 0o500); "
                "b.publish(b.stage([b'next'], 4), 'd/n', mode=0o644); print(b.read_all('d/w'), b.read_all('d/n'))")
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
                           capture_output=True, text=True, timeout=60, cwd="/")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "b'secret' b'next'"
    finally:
        shutil.rmtree(root)


def _hf_train(output_dir, max_steps: int, resume: bool) -> None:
    import torch
    import transformers

    from tests.hfutil import tiny_gpt2, tiny_tokens

    torch.manual_seed(0)
    args = transformers.TrainingArguments(output_dir=str(output_dir), max_steps=max_steps, save_steps=2, save_total_limit=2,
                                          per_device_train_batch_size=4, report_to=[], use_cpu=True, logging_steps=100, disable_tqdm=True)
    transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=tiny_tokens()).train(resume_from_checkpoint=True if resume else None)


def _checkpoints(d) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("checkpoint-"))


def test_hf_trainer_resumed_after_a_remount_keeps_what_plain_disk_keeps(tmp_path):
    """HF Trainer rotates checkpoints by directory mtime: after a restart the
    directories must carry their mtimes, or it deletes the newest one."""
    import pytest

    pytest.importorskip("transformers")
    disk = tmp_path / "disk"
    disk.mkdir()
    _hf_train(disk / "out", 10, resume=False)
    _hf_train(disk / "out", 12, resume=True)
    expected = _checkpoints(disk / "out")
    assert expected == ["checkpoint-10", "checkpoint-12"]

    m = start_mount(tmp_path / "ckptfs")
    try:
        _hf_train(m.path("out"), 10, resume=False)
        mtimes = {c: os.stat(m.path("out", c)).st_mtime_ns for c in _checkpoints(m.path("out"))}
        assert run_cli("umount", str(m.mountpoint)).returncode == 0
    finally:
        stop_mount(m)
    m = start_mount(tmp_path / "ckptfs")
    try:
        # what rotation goes by (which of the two a restart happens to list first decides the rest otherwise)
        assert {c: os.stat(m.path("out", c)).st_mtime_ns for c in _checkpoints(m.path("out"))} == mtimes
        _hf_train(m.path("out"), 12, resume=True)
        assert _checkpoints(m.path("out")) == expected
        assert run_cli("umount", str(m.mountpoint)).returncode == 0
        assert _checkpoints(m.store / "out") == expected
    finally:
        stop_mount(m)


def rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def test_sparse_files_stay_sparse_in_the_store_and_after_a_restart(tmp_path):
    """Holes cost nothing: not in RAM, not in a local store (seeked past, not
    written), not when loaded back after a restart; the bytes verify."""
    size = 8 << 30
    m = start_mount(tmp_path)
    try:
        with open(m.path("sparse.bin"), "wb") as f:
            f.truncate(size)
            f.seek(3 << 30)
            f.write(b"middle")
            f.seek(size - 4)
            f.write(b"tail")
        assert run_cli("flush", str(m.mountpoint), "--timeout", "120").returncode == 0
        st = os.stat(m.store / "sparse.bin")
        assert st.st_size == size and st.st_blocks * 512 <= (8 << 20), st.st_blocks  # the two chunks written
        assert run_cli("umount", str(m.mountpoint)).returncode == 0
    finally:
        stop_mount(m)
    m = start_mount(tmp_path)
    try:
        base = rss(m.pid)
        with open(m.path("sparse.bin"), "rb") as f:
            f.seek(3 << 30)
            assert f.read(6) == b"middle"
            f.seek(size - 4)
            assert f.read() == b"tail"
            f.seek(1 << 30)
            assert f.read(4096) == bytes(4096)
        assert os.stat(m.path("sparse.bin")).st_size == size
        assert rss(m.pid) < base + (256 << 20)  # loaded without holding its holes
        r = run_cli("verify", str(m.mountpoint))
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        stop_mount(m)


def test_files_ending_in_a_hole_keep_their_size_in_a_local_store(tmp_path):
    """The store file is sized by its last hole, not by its last bytes
    written (a small file written whole at publication, and a large staged
    one; and one that is all hole)."""
    m = start_mount(tmp_path)
    try:
        sizes = {"small.bin": (b"head", 60_000), "large.bin": (os.urandom(1 << 20), 100 << 20), "hole.bin": (b"", 5000)}
        for name, (data, size) in sizes.items():
            with open(m.path(name), "wb") as f:
                f.write(data)
                f.truncate(size)
        assert run_cli("flush", str(m.mountpoint), "--timeout", "120").returncode == 0
        for name, (data, size) in sizes.items():
            with open(m.store / name, "rb") as f:
                assert os.fstat(f.fileno()).st_size == size, name
                assert f.read(len(data)) == data
                f.seek(size - 4096)
                assert f.read() == bytes(4096), name
        r = run_cli("verify", str(m.mountpoint))
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        stop_mount(m)


def test_a_file_larger_than_the_ram_budget_reads_back_after_a_restart(tmp_path):
    """Read in place from the local store, verified block by block, and the
    daemon's RSS stays within the budget (it used to fetch the whole file
    into memory and then fail with ENOSPC); appended to, it loads into the
    spill directory, verified the same way, and the store gets the new
    bytes."""
    import hashlib

    spill = tmp_path / "spill"
    spill.mkdir()
    extra = ("--spill-dir", str(spill))
    block = os.urandom(1 << 20)
    want = hashlib.sha256()
    m = start_mount(tmp_path, memory_limit="128M", extra=extra)
    try:
        with open(m.path("big.bin"), "wb") as f:
            for i in range(400):
                piece = bytes([i % 251]) + block[1:]
                want.update(piece)
                f.write(piece)
        assert run_cli("umount", str(m.mountpoint)).returncode == 0
    finally:
        stop_mount(m)
    m = start_mount(tmp_path, memory_limit="128M", extra=extra)
    try:
        base = rss(m.pid)
        got = hashlib.sha256()
        with open(m.path("big.bin"), "rb") as f:
            while piece := f.read(8 << 20):
                got.update(piece)
        assert got.hexdigest() == want.hexdigest()
        assert rss(m.pid) < base + (128 << 20) + (128 << 20)
        assert "served in place" in m.log_text() and "into the spill directory" not in m.log_text()
        with open(m.path("big.bin"), "ab") as f:
            f.write(b"more")
        want.update(b"more")
        assert "into the spill directory" in m.log_text()
        assert rss(m.pid) < base + (128 << 20) + (128 << 20)
        assert run_cli("flush", str(m.mountpoint), "--timeout", "120").returncode == 0
        assert hashlib.sha256((m.store / "big.bin").read_bytes()).hexdigest() == want.hexdigest()
    finally:
        stop_mount(m)


def test_a_large_file_is_read_after_a_restart_from_the_local_store_not_copied_into_ram(tmp_path):
    """A cold torch.load after a restart used to copy the whole checkpoint
    into the daemon's memory first (2 GiB of fresh memory for a 2 GiB file,
    the daemon's RSS up by as much). Reads of a large file are served from
    the store's file, verified: the daemon's RSS stays flat (but for the
    few blocks held for the reader, which `--reuse-ram 0` gives back to
    the OS once let go); renamed in the mount meanwhile (its store file
    moves), it still reads back whole."""
    import hashlib

    data = os.urandom(1 << 20) * 300 + b"end"
    m = start_mount(tmp_path)
    try:
        m.path("big.bin").write_bytes(data)
        assert run_cli("umount", str(m.mountpoint)).returncode == 0
    finally:
        stop_mount(m)
    m = start_mount(tmp_path, extra=("--reuse-ram", "0"))
    try:
        base = rss(m.pid)
        assert hashlib.sha256(m.path("big.bin").read_bytes()).digest() == hashlib.sha256(data).digest()
        assert rss(m.pid) < base + (100 << 20), (rss(m.pid) - base) >> 20
        os.rename(m.path("big.bin"), m.path("moved.bin"))
        assert run_cli("flush", str(m.mountpoint), "--timeout", "60").returncode == 0
        with open(m.path("moved.bin"), "rb") as f:
            f.seek(len(data) - 3)
            assert f.read() == b"end"
            f.seek(0)
            assert hashlib.sha256(f.read()).digest() == hashlib.sha256(data).digest()
        assert rss(m.pid) < base + (100 << 20), (rss(m.pid) - base) >> 20
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1")  # read again from the store's disk: off the daemon's event loop
        assert hashlib.sha256(m.path("moved.bin").read_bytes()).digest() == hashlib.sha256(data).digest()
        r = run_cli("verify", str(m.mountpoint))
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        stop_mount(m)
