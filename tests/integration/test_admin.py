"""`ckptfs status | flush | prefetch | evict`, the control socket, the
`user.ckptfs.*` attributes and the Prometheus metrics, on real mounts."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import xxhash
from prometheus_client.parser import text_string_to_metric_families

from ckptfs import runtime
from ckptfs.client import AccessDenied, Client, DaemonUnavailable, FlushIncomplete, NotMounted
from tests.integration.test_cli import assert_clean_error
from tests.mountutil import run_cli, signal_and_wait, start_mount, stop_mount
from tests.ports import free_port
from tests.storeutil import StoreWatcher, begin_outage, end_outage, store_files, store_outage, wait_until

OUTAGE_LOG = ["failed (try", "Errno 20", "Not a directory", "FileExistsError", "NotADirectoryError"]


def status_json(path: Path | str, *args: str) -> dict:
    r = run_cli("status", str(path), "--json", *args)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["version"] == 1
    return out


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


# -- status ----------------------------------------------------------------------
def test_status_totals_files_and_all_mounts(fresh_mount):
    m = fresh_mount
    write(m.path("ck", "a.bin"), os.urandom(3 << 20))
    write(m.path("ck", "b.bin"), b"b" * 1000)
    write(m.path("other"), b"x")
    assert run_cli("flush", str(m.mountpoint)).returncode == 0

    s = status_json(m.mountpoint, "--files")
    t = s["totals"]
    assert s["mount"]["mountpoint"] == str(m.mountpoint) and s["mount"]["store"] == str(m.store)
    assert t["files"] == {"files": 3, "bytes": (3 << 20) + 1001}
    assert t["by_state"]["published"] == t["files"] and t["by_state"]["dirty"]["files"] == 0
    assert t["queue"] == 0 and t["oldest_unpublished_s"] == 0 and t["last_error"] == ""
    assert t["in_ram"]["files"] == 3 and t["budget_used"] > 0 and t["budget_limit"] == 4 << 30
    rows = {f["path"]: f for f in s["files"]}
    assert set(rows) == {"ck/a.bin", "ck/b.bin", "other"}
    assert rows["ck/b.bin"]["xxh3"] == xxhash.xxh3_128_hexdigest(b"b" * 1000)
    assert rows["ck/b.bin"]["state"] == "published" and rows["ck/b.bin"]["size"] == 1000 and rows["ck/b.bin"]["generation"] == 1

    # --files PATH: relative to the mountpoint, or absolute
    assert [f["path"] for f in status_json(m.mountpoint, "--files", "ck")["files"]] == ["ck/a.bin", "ck/b.bin"]
    assert [f["path"] for f in status_json(m.mountpoint, "--files", str(m.path("other")))["files"]] == ["other"]
    assert_clean_error(run_cli("status", str(m.mountpoint), "--files", "nope"), "no such file")
    # no MOUNTPOINT, an absolute PATH: the mount it is on (`status --files /mnt` listed nothing: an error)
    r = run_cli("status", "--json", "--files", str(m.mountpoint))
    assert r.returncode == 0 and json.loads(r.stdout)["mount"]["mountpoint"] == str(m.mountpoint), r.stderr
    assert {f["path"] for f in json.loads(r.stdout)["files"]} == set(rows)
    r = run_cli("status", "--json", "--files", str(m.path("ck")))
    assert [f["path"] for f in json.loads(r.stdout)["files"]] == ["ck/a.bin", "ck/b.bin"], r.stderr

    # human output: totals and a table naming each file and its state
    r = run_cli("status", str(m.mountpoint), "--files")
    assert r.returncode == 0, r.stderr
    assert "published" in r.stdout and "ck/a.bin" in r.stdout and rows["ck/a.bin"]["xxh3"] in r.stdout

    # no mountpoint: every ckptfs mount on the machine, whatever else is mounted (here, a dead one too)
    dead = start_mount(m.mountpoint.parent / "dead")
    try:
        os.kill(dead.pid, signal.SIGKILL)
        dead.proc.wait()
        r = run_cli("status", "--json")
        mounts = {x["mount"]["mountpoint"]: x for x in json.loads(r.stdout)["mounts"]}
        assert mounts[str(m.mountpoint)]["totals"]["files"]["files"] == 3
        assert "error" in mounts[str(dead.mountpoint)] and r.returncode == 3, r.stderr  # 3: some mount is unavailable
        r = run_cli("status")
        assert r.returncode == 3 and str(m.mountpoint) in r.stdout
        mine = next(ln for ln in r.stdout.splitlines() if ln.startswith(str(m.mountpoint) + " "))
        assert "unavailable" not in mine and "unavailable" in r.stdout
    finally:
        stop_mount(dead)


def test_status_shows_dirty_and_failed_while_the_store_is_down(fresh_mount):
    m = fresh_mount
    m.allowed_log_errors += OUTAGE_LOG
    with store_outage(m.store):
        write(m.path("stuck"), b"s" * 4096)
        # Held open by a process of its own: this one's children (run_cli) would each close a
        # copy at their exec, and a file left unwritten after that is sealed (InodeTree.closed).
        holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'w'); f.write('still being written'); "
                                   "f.flush(); print('ready', flush=True); time.sleep(600)", str(m.path("open"))], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline() == "ready\n"
        try:
            wait_until(lambda: status_json(m.mountpoint)["totals"]["by_state"]["failed"]["files"] == 1, 30, "FAILED shown")
            s = status_json(m.mountpoint, "--files")
            rows = {f["path"]: f for f in s["files"]}
            assert rows["stuck"]["tries"] >= 1 and "staging" in rows["stuck"]["error"]
            assert rows["open"]["state"] == "dirty" and rows["open"]["open_for_write"]
            t = s["totals"]
            assert t["queue"] == 1 and t["oldest_unpublished_s"] > 0 and "staging" in t["last_error"]
            assert t["failing"] == 1 and 0 <= t["last_error_age_s"] < 60
            r = run_cli("status", str(m.mountpoint))
            assert "failing" in r.stdout and "staging" in r.stdout, r.stdout
            # the error is shown below the totals: its length does not stretch their columns
            assert len(t["last_error"]) > 50 and max(len(line) for line in r.stdout.splitlines()[1:] if "staging" not in line) < 70, r.stdout
            assert t["counters"]["retries"] >= 1
            assert os.getxattr(m.path("stuck"), "user.ckptfs.state") == b"failed"
            assert b"staging" in os.getxattr(m.path("stuck"), "user.ckptfs.error")
        finally:
            holder.kill()
            holder.wait()
    assert run_cli("flush", str(m.mountpoint), "--timeout", "60").returncode == 0
    assert store_files(m.store) == {"stuck": b"s" * 4096, "open": b"still being written"}
    # recovered: the error is history (the log keeps it), not status
    t = status_json(m.mountpoint)["totals"]
    assert t["failing"] == 0 and t["last_error"] == "" and t["counters"]["retries"] >= 1
    assert "failing" not in run_cli("status", str(m.mountpoint)).stdout


def test_status_watch_refreshes_until_interrupted(shared_mount):
    # SIGINT as at a terminal: a test run started in the background (`cmd &` in a script) has it
    # ignored, the child would inherit that, and Python raises no KeyboardInterrupt then.
    p = subprocess.Popen([sys.executable, "-m", "ckptfs.tools.cli", "status", str(shared_mount.mountpoint), "--watch", "--interval", "0.2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(2.0)
    out, err = signal_and_wait(p, signal.SIGINT, 20)
    assert p.returncode == 0, err
    assert "Traceback" not in err
    assert out.count(str(shared_mount.mountpoint)) >= 3  # refreshed several times


def test_status_errors(tmp_path, shared_mount):
    assert_clean_error(r := run_cli("status", str(tmp_path)), "is not on a ckptfs mount")
    assert r.returncode == 2
    assert_clean_error(run_cli("status", "--files", "x"), "needs a MOUNTPOINT")
    assert_clean_error(run_cli("flush", str(tmp_path)), "is not on a ckptfs mount")
    assert_clean_error(run_cli("evict", str(tmp_path / "f")), "is not on a ckptfs mount")
    assert_clean_error(run_cli("prefetch", str(tmp_path)), "is not on a ckptfs mount")
    assert_clean_error(run_cli("flush", str(shared_mount.path("no", "such"))), "no such file")
    with pytest.raises(NotMounted):
        Client(tmp_path)


# -- flush -----------------------------------------------------------------------
def test_flush_times_out_while_the_store_is_down_then_succeeds(fresh_mount):
    m = fresh_mount
    m.allowed_log_errors += OUTAGE_LOG
    with store_outage(m.store):
        write(m.path("ck", "model.pt"), b"m" * 10_000)
        t0 = time.monotonic()
        r = run_cli("flush", str(m.path("ck")), "--timeout", "2")
        assert time.monotonic() - t0 < 30
        assert r.returncode == 1
        assert "not published after 2s" in r.stderr and "ck/model.pt" in r.stderr and "staging" in r.stderr
        with pytest.raises(FlushIncomplete) as exc:
            Client(m.mountpoint).flush(timeout=0.5)
        assert [f["path"] for f in exc.value.left] == ["ck/model.pt"] and exc.value.timed_out
    r = run_cli("flush", str(m.path("ck")))
    assert r.returncode == 0, r.stderr
    assert "flushed" in r.stdout and "(1 file," in r.stdout
    assert store_files(m.store) == {"ck/model.pt": b"m" * 10_000}


def test_a_flush_may_take_longer_than_the_client_timeout(fresh_mount):
    """Progress lines keep a long flush alive: only silence means hung."""
    m = fresh_mount
    m.allowed_log_errors += OUTAGE_LOG
    begin_outage(m.store)  # ended by a timer below

    def store_back() -> None:
        end_outage(m.store)

    write(m.path("late"), b"l" * 1000)
    ender = threading.Timer(3.0, store_back)
    ender.start()
    try:
        t0 = time.monotonic()
        assert Client(m.mountpoint, timeout=1.0).flush()["published"]
        assert time.monotonic() - t0 > 2.5
    finally:
        ender.join()
    assert store_files(m.store) == {"late": b"l" * 1000}


def _flush_in_background(path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ckptfs.tools.cli", "flush", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_flush_whose_daemon_exits_meanwhile_says_what_it_did_not_publish(tmp_path):
    """A flush waits; the mount is unmounted meanwhile (another shell's
    `umount`), and its daemon's drain ends with the file not published
    (the store down past --drain-timeout): the flush says so, naming it
    (it said "the daemon closed the connection", exit 3)."""
    m = start_mount(tmp_path, extra=("--drain-timeout", "2"))
    m.allowed_log_errors += [*OUTAGE_LOG, "NOT PUBLISHED", "changes not published"]
    flush = umount = None
    try:
        begin_outage(m.store)
        write(m.path("ck", "model.pt"), b"m" * 10_000)
        wait_until(lambda: "failed (try" in m.log_text(), 30, "a failed publication")
        flush = _flush_in_background(m.path("ck"))
        time.sleep(1)
        umount = subprocess.Popen([sys.executable, "-m", "ckptfs.tools.cli", "umount", str(m.mountpoint)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = flush.communicate(timeout=120)
        assert flush.returncode == 1, out + err
        assert "exited while the flush waited, with 1 file NOT published" in err and "ck/model.pt" in err, err
        assert umount.wait(timeout=60) == 1
    finally:
        for p in (flush, umount):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        stop_mount(m)


def test_a_flush_whose_daemon_is_killed_says_what_is_lost(tmp_path):
    m = start_mount(tmp_path)
    m.allowed_log_errors += OUTAGE_LOG
    flush = None
    try:
        begin_outage(m.store)
        write(m.path("model.pt"), b"m" * 10_000)
        wait_until(lambda: "failed (try" in m.log_text(), 30, "a failed publication")
        flush = _flush_in_background(m.mountpoint)
        time.sleep(1)
        m.proc.kill()
        out, err = flush.communicate(timeout=60)
        assert flush.returncode == 1 and "exited while the flush waited, without saying what it published" in err, out + err
    finally:
        if flush is not None and flush.poll() is None:
            flush.kill()
            flush.wait()
        stop_mount(m)


def test_flush_is_a_barrier_for_its_path(fresh_mount):
    """flush PATH waits for what was sealed under PATH before the call; the
    store has it when flush returns (C3 makes everything earlier visible too)."""
    m = fresh_mount
    for i in range(20):
        write(m.path("a", f"{i}.bin"), os.urandom(256 << 10))
    write(m.path("b", "last"), b"last")
    r = run_cli("flush", str(m.path("a")))
    assert r.returncode == 0, r.stderr
    files = store_files(m.store)
    assert all(f"a/{i}.bin" in files for i in range(20))
    result = Client(m.mountpoint).flush(m.path("b"), timeout=60)
    assert result["published"] and "b/last" in store_files(m.store)


def test_flush_names_files_still_open_with_changes_it_does_not_include(fresh_mount):
    """A job that flushes before it exits, with a log or an event file still
    open, learns that those changes are not in the store yet (they are sealed
    at close): flush says so, under its path only, and still exits 0."""
    m = fresh_mount
    write(m.path("ckpt", "model.pt"), b"weights")
    write(m.path("other", "closed"), b"x")
    # Held open by a job of their own: a descriptor of this process would be
    # closed in the flush's own child at its exec, and count as a close.
    job = subprocess.Popen([sys.executable, "-c", "import sys, time; a, b = open(sys.argv[1], 'w'), open(sys.argv[2], 'w'); "
                            "a.write('step 1\\n'); b.write('x'); a.flush(); b.flush(); print('ready', flush=True); time.sleep(600)",
                            str(m.path("ckpt", "events.log")), str(m.path("other", "open.log"))], stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline() == "ready\n"
        r = run_cli("flush", str(m.path("ckpt")))
        assert r.returncode == 0 and "flushed" in r.stdout, r.stderr
        assert "1 file still open for writing" in r.stderr and "ckpt/events.log" in r.stderr and "open.log" not in r.stderr, r.stderr
        assert "ckpt/model.pt" in store_files(m.store) and "ckpt/events.log" not in store_files(m.store)
    finally:
        job.kill()
        job.wait()
    r = run_cli("flush", str(m.mountpoint))
    assert r.returncode == 0 and "open for writing" not in r.stderr, r.stderr
    assert store_files(m.store)["ckpt/events.log"] == b"step 1\n"


# -- xattrs ----------------------------------------------------------------------
def test_file_state_as_extended_attributes(mnt):
    f = mnt / "w.pt"
    data = os.urandom(100_000)
    write(f, data)
    assert Client(mnt).flush(timeout=60)["published"]
    assert os.getxattr(f, "user.ckptfs.state") == b"published"
    assert os.getxattr(f, "user.ckptfs.xxh3") == xxhash.xxh3_128_hexdigest(data).encode()
    assert os.getxattr(f, "user.ckptfs.generation") == b"1"
    r = subprocess.run(["getfattr", "--only-values", "-n", "user.ckptfs.state", str(f)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "published"
    # virtual and read-only: not listed (cp -a must not copy them), not settable
    assert not [n for n in os.listxattr(f) if n.startswith("user.ckptfs.")]
    with pytest.raises(OSError) as exc:
        os.setxattr(f, "user.ckptfs.state", b"published")
    assert exc.value.errno == errno.EPERM
    with pytest.raises(OSError) as exc:
        os.getxattr(f, "user.ckptfs.error")  # none
    assert exc.value.errno == errno.ENODATA
    with pytest.raises(OSError):
        os.getxattr(mnt, "user.ckptfs.state")  # directories have no state
    # rewriting makes it dirty until published again
    fd = os.open(f, os.O_WRONLY)
    try:
        os.write(fd, b"new")
        assert os.getxattr(f, "user.ckptfs.state") == b"dirty"
    finally:
        os.close(fd)


# -- evict / prefetch ------------------------------------------------------------
def test_evict_and_prefetch(fresh_mount):
    m = fresh_mount
    data = {f"ck/{i}.bin": os.urandom(1 << 20) for i in range(3)}
    for p, d in data.items():
        write(m.path(p), d)
    assert run_cli("flush", str(m.mountpoint)).returncode == 0
    used = status_json(m.mountpoint)["totals"]["budget_used"]

    r = run_cli("evict", str(m.path("ck")))
    assert r.returncode == 0, r.stderr
    assert "evicted 3 files" in r.stdout
    t = status_json(m.mountpoint)["totals"]
    assert t["evicted"]["files"] == 3 and t["in_ram"]["files"] == 0 and t["budget_used"] < used
    assert t["counters"]["evictions"] == 3

    r = run_cli("prefetch", str(m.path("ck", "1.bin")))
    assert r.returncode == 0, r.stderr
    assert "loaded 1 file (1.0 MiB)" in r.stdout
    t = status_json(m.mountpoint)["totals"]
    assert t["evicted"]["files"] == 2 and t["counters"]["loads"] == 1
    assert run_cli("prefetch", str(m.mountpoint)).stdout.startswith("ckptfs: loaded 2 files")

    # several PATHs (a shell's glob), their totals told together
    r = run_cli("evict", *(str(m.path(p)) for p in data))
    assert r.returncode == 0 and "evicted 3 files (3.0 MiB)" in r.stdout, r.stdout + r.stderr
    r = run_cli("prefetch", str(m.path("ck", "0.bin")), str(m.path("ck", "2.bin")))
    assert r.returncode == 0 and "loaded 2 files (2.0 MiB)" in r.stdout, r.stdout + r.stderr
    assert status_json(m.mountpoint)["totals"]["evicted"]["files"] == 1
    assert_clean_error(run_cli("evict", str(m.path("ck", "1.bin")), str(m.path("nope"))), "no such file")
    assert status_json(m.mountpoint)["totals"]["evicted"]["files"] == 1  # nothing done when one PATH is wrong
    for p, d in data.items():
        assert m.path(p).read_bytes() == d


def test_prefetch_names_the_files_it_cannot_load_and_loads_the_rest(tmp_path):
    """A file that cannot be loaded (here: rotten in the store) failed the
    whole prefetch with "internal error" and a traceback in the daemon's
    log (the load's error came wrapped by the progress nursery), and the
    files after it were not loaded."""
    m = start_mount(tmp_path)
    try:
        m.path("ck").mkdir()
        for name in ("a.bin", "b.bin", "c.bin"):
            m.path("ck", name).write_bytes(name.encode() * 20_000)
    finally:
        stop_mount(m)
    (m.store / "ck" / "b.bin").write_bytes(b"x" * 100_000)  # bit rot, same size
    again = start_mount(tmp_path)
    again.allowed_log_errors.append("checksum mismatch")
    try:
        r = run_cli("prefetch", str(again.path("ck")))
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert "loaded 2 files" in r.stdout
        assert "1 file not loaded" in r.stderr and "ck/b.bin: checksum mismatch" in r.stderr, r.stderr
        t = status_json(again.mountpoint)["totals"]
        assert t["in_ram"]["files"] == 2 and t["evicted"]["files"] == 1
        assert not again.unexpected_log_errors(), again.unexpected_log_errors()
        assert Client(again.mountpoint).prefetch(again.path("ck"))["failed"][0]["path"] == "ck/b.bin"
    finally:
        stop_mount(again)


def test_a_file_in_the_store_only_has_its_blocks_and_tar_sparse_copies_its_bytes(tmp_path):
    """A file evicted, or not loaded since a restart, said st_blocks 0:
    `tar --sparse` took it for all holes and archived zeros, silently. Its
    blocks are its size now (what the store holds); a sparse file in RAM
    still says what it takes."""
    data = os.urandom(3 << 20)

    def archived(m, name: str) -> bytes:
        out = tmp_path / "tar-out"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        subprocess.run(["tar", "-S", "-cf", str(tmp_path / "t.tar"), "-C", str(m.mountpoint), name], check=True)
        subprocess.run(["tar", "-xf", str(tmp_path / "t.tar"), "-C", str(out)], check=True)
        return (out / name).read_bytes()

    m = start_mount(tmp_path)
    try:
        write(m.path("dense.bin"), data)
        with open(m.path("sparse.bin"), "wb") as f:
            f.truncate(64 << 20)
        assert os.stat(m.path("sparse.bin")).st_blocks == 0
        assert run_cli("flush", str(m.mountpoint)).returncode == 0
        assert run_cli("evict", str(m.path("dense.bin"))).returncode == 0
        assert archived(m, "dense.bin") == data
        r = run_cli("umount", str(m.mountpoint))
        assert r.returncode == 0, r.stderr
    finally:
        stop_mount(m)
    again = start_mount(tmp_path)
    try:
        assert os.stat(again.path("dense.bin")).st_blocks * 512 >= len(data)
        assert archived(again, "dense.bin") == data
        assert archived(again, "sparse.bin") == bytes(64 << 20)
    finally:
        stop_mount(again)


def test_a_spilled_file_has_its_blocks_and_tar_sparse_copies_its_bytes(tmp_path):
    """A file the RAM budget could not hold lives in the spill directory: it
    said st_blocks 0 (its RAM), and `tar --sparse` archived zeros for it,
    silently. It says what its spill file takes, holes still none."""
    spill = tmp_path / "spill"
    spill.mkdir()
    data = os.urandom(24 << 20)
    m = start_mount(tmp_path, memory_limit="16M", extra=("--spill-dir", str(spill)))
    m.allowed_log_errors.append("RAM budget")
    try:
        write(m.path("big.bin"), data)
        assert "continuing big.bin (" in m.log_text()  # spilled, as meant (named by its path)
        assert os.stat(m.path("big.bin")).st_blocks * 512 >= len(data)
        subprocess.run(["tar", "-S", "-cf", str(tmp_path / "t.tar"), "-C", str(m.mountpoint), "big.bin"], check=True)
        out = tmp_path / "out"
        out.mkdir()
        subprocess.run(["tar", "-xf", str(tmp_path / "t.tar"), "-C", str(out)], check=True)
        assert (out / "big.bin").read_bytes() == data
        with open(m.path("big.bin"), "r+b") as f:  # a hole made in the spill file stays one
            f.truncate(64 << 20)
        assert os.stat(m.path("big.bin")).st_blocks * 512 < (48 << 20)
    finally:
        stop_mount(m)


def test_admin_paths_follow_symlinks_in_the_mount(fresh_mount):
    """`ckptfs evict /mnt/ckpt/latest/model.pt` (a `latest` link to the
    newest checkpoint, as Lightning's save_last="link" and many scripts
    keep) named no file for the daemon; a link in the path, or at its end,
    is followed as the kernel would, and one leading out of the mount is
    a one-line error."""
    m = fresh_mount
    write(m.path("step-3", "model.pt"), os.urandom(1 << 20))
    os.symlink("step-3", m.path("latest"))
    os.symlink(str(m.path("step-3")), m.path("latest-absolute"))
    os.symlink("/etc", m.path("outside"))
    assert run_cli("flush", str(m.path("latest"))).returncode == 0
    r = run_cli("evict", str(m.path("latest", "model.pt")))
    assert r.returncode == 0 and "evicted 1 file" in r.stdout, r.stdout + r.stderr
    r = run_cli("prefetch", str(m.path("latest-absolute")))
    assert r.returncode == 0 and "loaded 1 file" in r.stdout, r.stdout + r.stderr
    r = run_cli("evict", str(m.path("latest")))
    assert r.returncode == 0 and "evicted 1 file" in r.stdout, r.stdout + r.stderr
    r = run_cli("evict", str(m.path("outside", "passwd")))
    assert r.returncode != 0 and "leads out of the mount" in r.stderr and "Traceback" not in r.stderr


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def test_evict_returns_ram_to_the_os_beyond_the_reuse_bound(tmp_path):
    """Freed chunks are kept for reuse only up to --reuse-ram; evicting
    everything gives the rest back to the OS (RSS falls) before the answer
    comes (the pool's thread unmaps them: the daemon waits for it; without
    that wait this test's first look finds most of the memory still
    there), and a reused chunk never shows stale bytes."""
    m = start_mount(tmp_path, memory_limit="2G", extra=("--reuse-ram", "64M"))
    try:
        base = rss(m.pid)
        data = os.urandom(1 << 20) * 400
        write(m.path("big.bin"), data)
        assert rss(m.pid) > base + (370 << 20)
        assert run_cli("flush", str(m.mountpoint)).returncode == 0
        assert Client(m.mountpoint).evict()["evicted"] == 1
        assert rss(m.pid) < base + (64 << 20) + (100 << 20)  # at once
        write(m.path("again.bin"), data)
        assert run_cli("flush", str(m.mountpoint)).returncode == 0
        r = run_cli("evict", str(m.mountpoint))
        assert r.returncode == 0 and "evicted 1 file" in r.stdout, r.stdout + r.stderr
        assert rss(m.pid) < base + (64 << 20) + (100 << 20)
        write(m.path("small.bin"), b"s" * (3 << 20))  # into a reused chunk
        assert m.path("small.bin").read_bytes() == b"s" * (3 << 20)
        assert m.path("big.bin").read_bytes() == data  # loaded again from the store
    finally:
        stop_mount(m)


def test_evict_refuses_unpublished_files(fresh_mount):
    m = fresh_mount
    m.allowed_log_errors += OUTAGE_LOG
    write(m.path("done"), b"d" * 5000)
    assert run_cli("flush", str(m.mountpoint)).returncode == 0
    with store_outage(m.store):
        write(m.path("pending"), b"p" * 5000)
        r = run_cli("evict", str(m.mountpoint))
        assert r.returncode == 1
        assert "evicted 1 file" in r.stdout
        assert "pending" in r.stderr and "not published" in r.stderr
        r = run_cli("evict", str(m.path("pending")))
        assert r.returncode == 1 and "evicted 0 files" in r.stdout
        assert m.path("pending").read_bytes() == b"p" * 5000  # still there, from RAM
        rows = {f["path"]: f for f in status_json(m.mountpoint, "--files")["files"]}
        assert rows["pending"]["resident"] and not rows["done"]["resident"]
    assert run_cli("flush", str(m.mountpoint), "--timeout", "60").returncode == 0
    assert m.path("done").read_bytes() == b"d" * 5000


# -- the control endpoint --------------------------------------------------------
def test_client_detects_a_hung_and_a_dead_daemon(fresh_mount):
    m = fresh_mount
    os.kill(m.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable) as exc:
            Client(m.mountpoint, timeout=1.0).status()
        assert exc.value.hung and time.monotonic() - t0 < 10
        t0 = time.monotonic()
        r = run_cli("status", str(m.mountpoint), "--timeout", "1", timeout=60)
        assert r.returncode == 3 and "did not answer within 1s" in r.stderr and time.monotonic() - t0 < 8, (r.stderr, time.monotonic() - t0)
        r = run_cli("status", "--timeout", "1")  # every mount: this one's line says it did not answer
        assert r.returncode == 3 and "did not answer within 1s" in " ".join(r.stdout.split()), r.stdout
    finally:
        os.kill(m.pid, signal.SIGCONT)
    assert Client(m.mountpoint).ping()["pid"] == m.pid
    # A daemon that dies while a request waits on it, unread: DaemonUnavailable (one line from the CLI), no traceback
    os.kill(m.pid, signal.SIGSTOP)
    got: list[BaseException] = []

    def status() -> None:
        try:
            Client(m.mountpoint, timeout=60).status()
        except BaseException as exc:
            got.append(exc)

    waiting = threading.Thread(target=status)
    waiting.start()
    time.sleep(1)  # connected, its request sent
    os.kill(m.pid, signal.SIGKILL)
    waiting.join(60)
    assert len(got) == 1 and isinstance(got[0], DaemonUnavailable) and "closed the connection" in str(got[0]), got
    m.proc.wait()
    with pytest.raises(DaemonUnavailable) as exc:
        Client(m.mountpoint).status()
    assert not exc.value.hung and "not running" in str(exc.value)
    r = run_cli("status")  # one dead mount does not hide the others
    assert r.returncode == 3 and "unavailable" in r.stdout


def test_sigusr1_logs_what_every_task_and_thread_waits_on(fresh_mount):
    """For a mount that stopped answering: the dump names each await stack."""
    m = fresh_mount
    m.path("f").write_bytes(b"x")
    os.kill(m.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while "task dump ends" not in m.log_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    dump = m.log_text().split("task dump (SIGUSR1)", 1)[1].split("task dump ends")[0].splitlines()
    tasks = "\n".join(line for line in dump if "tasks: task " in line)
    threads = "\n".join(line for line in dump if "tasks: thread " in line)
    assert "mount.py" in tasks and "_seal_closed > " in tasks and "sleep" in tasks  # a task, indented, with its stack
    assert "engine.py" in tasks
    assert "thread MainThread: " in threads and "tasks.py" in threads and "thread_lines" in threads
    assert m.path("f").read_bytes() == b"x" and Client(m.mountpoint).ping()["pid"] == m.pid  # the mount serves on


def _as_nobody(fn) -> str:
    """Run fn() in a child process with uid/gid 65534; returns what it printed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            out = fn()
        except BaseException as exc:
            out = f"{type(exc).__name__}: {exc}"
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


def test_control_endpoint_refuses_another_user(fresh_mount):
    m = fresh_mount
    sock_path = str(runtime.control_socket(m.mountpoint))
    assert os.stat(sock_path).st_mode & 0o777 == 0o600
    assert os.stat(runtime.mount_dir(m.mountpoint)).st_mode & 0o777 == 0o700

    def raw() -> str:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        s.connect(sock_path)
        with contextlib.suppress(BrokenPipeError):  # refused at once, before the request went: the refusal is there to read
            s.sendall(b'{"version": 1, "op": "status"}\n')
        return s.recv(65536).decode()

    # The client says who may control the mount, without trying.
    assert _as_nobody(lambda: str(Client(m.mountpoint))).startswith("AccessDenied: ")
    assert "only that user" in _as_nobody(lambda: str(Client(m.mountpoint)))
    # File permissions keep others from the socket...
    assert _as_nobody(raw).startswith("PermissionError")
    # ...and were they loosened, the daemon itself refuses other uids.
    os.chmod(runtime.runtime_root(), 0o755)
    os.chmod(runtime.mount_dir(m.mountpoint), 0o755)
    os.chmod(sock_path, 0o666)
    m.allowed_log_errors.append("refused a client with uid 65534")
    reply = json.loads(_as_nobody(raw))
    assert reply["ok"] is False and reply["kind"] == "access" and "uid 65534" in reply["error"]
    assert Client(m.mountpoint).ping()["pid"] == m.pid  # the owner still gets in
    assert AccessDenied  # (raised by Client for the kind above)


def test_control_endpoint_rejects_bad_requests(shared_mount):
    c = Client(shared_mount.mountpoint)
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(str(c.socket_path))
    s.sendall(b"not json\n")
    assert "malformed" in json.loads(s.recv(65536))["error"]
    s.close()
    from ckptfs.client import RequestFailed

    with pytest.raises(RequestFailed, match="unknown request"):
        c.call("format-disk")


# -- metrics ---------------------------------------------------------------------
def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def test_metrics_agree_with_status(tmp_path):
    port = free_port()
    m = start_mount(tmp_path, extra=("--metrics-port", str(port), "--metrics-host", "127.0.0.1"))
    try:
        for i in range(4):
            write(m.path("ck", f"{i}.bin"), os.urandom(200_000 + i))
        assert run_cli("flush", str(m.mountpoint)).returncode == 0
        assert run_cli("evict", str(m.path("ck", "0.bin"))).returncode == 0
        assert m.path("ck", "0.bin").read_bytes()  # read-through
        s = status_json(m.mountpoint)["totals"]
        got = _scrape(port)
        for state in ("dirty", "uploading", "staged", "failed", "published"):
            assert got[f"ckptfs_files{{state={state}}}"] == s["by_state"][state]["files"]
            assert got[f"ckptfs_file_bytes{{state={state}}}"] == s["by_state"][state]["bytes"]
        assert got["ckptfs_files{state=published}"] == 4
        assert got["ckptfs_held_files{where=ram}"] == s["in_ram"]["files"]
        assert got["ckptfs_held_files{where=evicted}"] == s["evicted"]["files"]
        assert got["ckptfs_ram_budget_bytes"] == s["budget_limit"]
        assert got["ckptfs_ram_used_bytes"] == s["budget_used"]
        assert got["ckptfs_queue_length"] == s["queue"] == 0
        assert got["ckptfs_published_files_total"] == s["counters"]["published_files"] == 4
        assert got["ckptfs_uploaded_bytes_total"] == s["counters"]["uploaded_bytes"] == sum(200_000 + i for i in range(4))
        assert got["ckptfs_evictions_total"] == s["counters"]["evictions"] == 1
        assert got["ckptfs_read_through_files_total"] == s["counters"]["loads"] == 1
        assert got["ckptfs_retries_total"] == got["ckptfs_failures_total"] == 0
        assert got["ckptfs_fuse_request_seconds_count{op=create}"] >= 4
        assert got["ckptfs_fuse_request_seconds_count{op=write}"] >= 4
        # each request in exactly one latency bucket (cumulative: +Inf holds them all), and its time summed
        creates = got["ckptfs_fuse_request_seconds_count{op=create}"]
        assert got["ckptfs_fuse_request_seconds_bucket{le=+Inf,op=create}"] == creates
        assert got["ckptfs_fuse_request_seconds_bucket{le=2.5e-05,op=create}"] <= got["ckptfs_fuse_request_seconds_bucket{le=10.0,op=create}"] == creates
        assert 0 < got["ckptfs_fuse_request_seconds_sum{op=create}"] < creates
        # errors by operation and errno: a directory that is not empty, removed (twice)
        for _ in range(2):
            with pytest.raises(OSError) as err:
                os.rmdir(m.path("ck"))
            assert err.value.errno == errno.ENOTEMPTY
        key = f"ckptfs_fuse_request_errors_total{{errno={errno.ENOTEMPTY},op=rmdir}}"
        assert _scrape(port)[key] == got.get(key, 0) + 2
        assert got["ckptfs_upload_bytes_per_second"] > 0
        # one INFO line per published file, with size and throughput
        wait_until(lambda: m.log_text().count("published ck/") == 4, 10, "log lines")
        assert "published ck/3.bin (200003 bytes" in m.log_text() and "MB/s" in m.log_text()
    finally:
        stop_mount(m)


def test_the_fuse_loop_polls_for_the_next_request_before_it_sleeps(tmp_path):
    """The daemon serves FUSE requests with its own wait for the next one
    (`daemon/fuseloop.py`): a wait that finds no request queued, with no
    store call at work, polls the device before the loop sleeps (at least
    one such wait in 17 does, whatever the timing), counted by
    `ckptfs_fuse_polls_total`. A process that opens and closes a file, then
    pauses, leaves at least one such wait each time (400 times: 24 polls at
    least; half that asked, for a store call such as a heartbeat meanwhile)."""
    port = free_port()
    m = start_mount(tmp_path, extra=("--metrics-port", str(port), "--metrics-host", "127.0.0.1"))
    found, nothing = "ckptfs_fuse_polls_total{found=request}", "ckptfs_fuse_polls_total{found=nothing}"
    try:
        m.path("f").write_bytes(b"x")
        assert run_cli("flush", str(m.mountpoint)).returncode == 0  # no store call at work from here on
        before = _scrape(port)
        for _ in range(400):
            os.close(os.open(m.path("f"), os.O_RDONLY))
            time.sleep(0.002)  # the daemon's wait for the next request finds the device empty
        got = _scrape(port)
        polls = got[found] + got[nothing] - before[found] - before[nothing]
        assert polls >= 200 // 17, (before[found], before[nothing], got[found], got[nothing])
    finally:
        stop_mount(m)


def test_a_name_that_is_not_there_is_asked_of_the_daemon_once_and_a_name_made_is_there_at_once(tmp_path):
    """A process probing for files (an import, a framework looking for
    optional files) asked the daemon each time: the kernel now keeps the
    answer (a negative entry). A name made through the mount, in any way,
    is there at once, whatever was asked before; one removed is gone."""
    port = free_port()
    m = start_mount(tmp_path, extra=("--metrics-port", str(port), "--metrics-host", "127.0.0.1"))
    lookups = "ckptfs_fuse_request_seconds_count{op=lookup}"
    try:
        before = _scrape(port).get(lookups, 0)
        for _ in range(50):
            assert not m.path("probe").exists()
        assert _scrape(port)[lookups] - before < 5  # (50 before)
        makers = {
            "file": lambda p: p.write_bytes(b"x"),
            "dir": lambda p: p.mkdir(),
            "symlink": lambda p: p.symlink_to("probe-file"),
            "link": lambda p: os.link(m.path("probe-file"), p),
            "fifo": lambda p: os.mkfifo(p),
            "renamed": lambda p: (m.path("tmp").write_bytes(b"y"), os.rename(m.path("tmp"), p)),
        }
        for kind, make in makers.items():
            p = m.path(f"probe-{kind}")
            assert not os.path.lexists(p)
            make(p)
            assert os.path.lexists(p), kind
        for kind in makers:
            p = m.path(f"probe-{kind}")
            os.rmdir(p) if kind == "dir" else os.unlink(p)
            assert not os.path.lexists(p), kind
        assert not m.path("probe-file").exists()
        m.path("probe-file").write_bytes(b"again")
        assert m.path("probe-file").read_bytes() == b"again"
    finally:
        stop_mount(m)


def test_a_file_is_sealed_at_close_even_while_a_forked_child_holds_it(tmp_path):
    """close(2) waits for the kernel's FLUSH; RELEASE comes later, in the
    background, and only once no process holds the open file. A file was
    sealed only at its release, so a flush right after a close could miss
    it (it said "published", naming the file as still open), and a file
    open when a process forked (a DataLoader worker, for its whole life)
    was not published at all. It is sealed at close now."""
    m = start_mount(tmp_path)
    try:
        fd = os.open(m.path("ckpt.pt"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"weights" * 1000)
        child = os.fork()
        if child == 0:  # holds the open file, as a worker forked during a save does
            time.sleep(120)
            os._exit(0)
        try:
            os.close(fd)
            r = run_cli("flush", str(m.mountpoint))
            assert r.returncode == 0 and "still open" not in r.stdout, r.stdout
            assert store_files(m.store) == {"ckpt.pt": b"weights" * 1000}
        finally:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
    finally:
        stop_mount(m)


def _forked_holder() -> int:
    """A child that holds every open file of this process, as a worker
    forked during a save does; the caller kills it."""
    child = os.fork()
    if child == 0:
        time.sleep(120)
        os._exit(0)
    return child


def _reap(child: int) -> None:
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)


def test_a_file_closed_while_a_forked_child_holds_it_is_published_unasked_and_in_order(tmp_path):
    """A checkpoint's data closed while a forked child holds it, then its
    completion marker: the store never shows the marker without the data
    (the data was sealed only when the child let go; the marker, opened
    after the fork, at once), and the data reaches the store with no flush
    asked for."""
    data = os.urandom(1 << 20)

    def check(snap: dict[str, bytes]) -> list[str]:
        return ["the marker came before the data"] if "ck/done" in snap and snap.get("ck/data") != data else []

    m = start_mount(tmp_path)
    try:
        os.mkdir(m.path("ck"))
        with StoreWatcher(m.store, check) as w:
            fd = os.open(m.path("ck", "data"), os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, data)
            child = _forked_holder()
            try:
                os.close(fd)
                write(m.path("ck", "done"), b"ok")
                wait_until(lambda: store_files(m.store).get("ck/done") == b"ok", 30, "the marker published")
                assert store_files(m.store)["ck/data"] == data
            finally:
                _reap(child)
            fd = os.open(m.path("alone"), os.O_WRONLY | os.O_CREAT, 0o644)  # and nothing after it
            os.write(fd, b"x")
            child = _forked_holder()
            try:
                os.close(fd)
                wait_until(lambda: "alone" in store_files(m.store), 30, "a file closed under a fork published with no flush")
            finally:
                _reap(child)
        assert w.polls > 0 and not w.violations, w.violations
    finally:
        stop_mount(m)


def test_a_forked_child_closing_its_copy_seals_nothing_the_writer_still_writes(tmp_path):
    """A child forked while a file is being written exits (or execs) and so
    closes its copy of the descriptor: the kernel says FLUSH, as at the
    writer's own close. The writer goes on writing: the half written then
    must never be published as the file."""
    m = start_mount(tmp_path)
    try:
        with StoreWatcher(m.store) as w:
            fd = os.open(m.path("model.pt"), os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, b"first half ")
            child = os.fork()
            if child == 0:
                os._exit(0)  # closes its copy: FLUSH
            os.waitpid(child, 0)
            os.write(fd, b"second half")
            os.close(fd)
            assert run_cli("flush", str(m.mountpoint)).returncode == 0
        assert store_files(m.store) == {"model.pt": b"first half second half"}
        assert "generation 2" not in m.log_text()  # one generation: the whole file
        assert not w.violations, w.violations
    finally:
        stop_mount(m)


def test_metrics_port_in_use_is_a_clean_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        (tmp_path / "mnt").mkdir()
        r = run_cli("mount", str(tmp_path / "mnt"), "--store", str(tmp_path / "s"), "--metrics-port", str(port))
        assert_clean_error(r, f"--metrics-port {port}")
        assert r.returncode == 2


# -- the log -----------------------------------------------------------------------
def test_an_outage_logs_one_error_per_change_not_one_per_retry(fresh_mount):
    """ERROR is for what a user must act on: once per change when it counts
    as failed (3 tries), then a reminder a minute at most; a RAM budget
    that a write gets past by evicting or spilling is no error at all."""
    m = fresh_mount
    m.allowed_log_errors += OUTAGE_LOG
    with store_outage(m.store):
        for i in range(3):
            write(m.path(f"f{i}"), b"x" * (128 << 10))  # staged ahead: each upload fails on its own
        wait_until(lambda: all(f["tries"] >= 4 for f in status_json(m.mountpoint, "--files")["files"]), 30, "four tries of each file")
    assert run_cli("flush", str(m.mountpoint), "--timeout", "60").returncode == 0
    errors = [ln for ln in m.log_text().splitlines() if " ERROR " in ln]
    assert len(errors) == 3 and all("(try 3)" in ln for ln in errors), errors


def _exchange(a, b) -> None:
    """renameat2(RENAME_EXCHANGE): swap two paths atomically."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), 2) != 0:  # AT_FDCWD, RENAME_EXCHANGE
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))


def test_a_write_larger_than_ram_continues_on_disk_while_the_store_is_down(tmp_path):
    """Spilling does not depend on the store: its default place is on local
    disk, outside the store (it used to be inside a local store, so a store
    outage failed the write with ENOTDIR once RAM was full)."""
    m = start_mount(tmp_path, memory_limit="16M")
    m.allowed_log_errors += [*OUTAGE_LOG, "RAM budget full", "heartbeat"]
    meta, away = m.store / ".ckptfs", tmp_path / "ckptfs-away"
    try:
        os.rename(meta, away)
        meta.write_bytes(b"the store is down")
        try:
            payload = os.urandom(32 << 20)
            write(m.path("big"), payload)  # twice the budget
        finally:
            _exchange(away, meta)  # in one step: the daemon, retrying, may make `.ckptfs` again in any gap
            away.unlink()
        assert run_cli("flush", str(m.mountpoint), "--timeout", "120").returncode == 0
        assert (m.store / "big").read_bytes() == payload
    finally:
        stop_mount(m)
    assert not m.unexpected_log_errors()
