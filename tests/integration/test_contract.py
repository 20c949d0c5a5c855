"""The contract C1-C9 (../shared/design.md) on real mounts and real stores."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.mountutil import drop_caches, is_mounted, run_cli, start_mount, stop_mount
from tests.storeutil import StoreWatcher, store_files, store_outage, verify_store, wait_store_matches, wait_until

torch = pytest.importorskip("torch")

RETRY_LOG = ("failed (try", "retrying", "NOT PUBLISHED", "not published", "received SIGTERM again")


@pytest.fixture
def m(tmp_path):
    mount = start_mount(tmp_path)
    try:
        yield mount
    finally:
        stop_mount(mount)


def umount(mount, *args: str) -> subprocess.CompletedProcess:
    return run_cli("umount", str(mount.mountpoint), *args, timeout=300)


# -- C1 -------------------------------------------------------------------------
def test_C1_fsync_ram_returns_while_the_store_is_down(m):
    m.allowed_log_errors += RETRY_LOG
    with store_outage(m.store):
        with open(m.path("model.pt"), "wb") as f:
            f.write(b"weights")
            f.flush()
            os.fsync(f.fileno())  # returns: the data is in RAM
        assert "model.pt" not in store_files(m.store)
    wait_store_matches(m.store, {"model.pt": b"weights"})


def test_C1_fsync_durable_waits_for_publication(tmp_path):
    """--fsync=durable returns once the file is published: through a store
    outage it waits (a retryable error is not a failure: no EIO), and returns
    once the store is back and the file is in it."""
    import threading

    mount = start_mount(tmp_path, extra=("--fsync", "durable"))
    mount.allowed_log_errors += RETRY_LOG
    try:
        with open(mount.path("shard.distcp"), "wb") as f:
            f.write(b"s" * 100_000)
            f.flush()
            os.fsync(f.fileno())
            assert store_files(mount.store) == {"shard.distcp": b"s" * 100_000}  # before close
            result: list = []
            with store_outage(mount.store):
                f.write(b"more")
                f.flush()
                t = threading.Thread(target=lambda: result.append(_fsync(f.fileno())), daemon=True)
                t.start()
                t.join(2.0)
                assert t.is_alive(), f"fsync returned {result} while the store was down"
            t.join(120)
            assert result == [None]
            assert store_files(mount.store) == {"shard.distcp": b"s" * 100_000 + b"more"}
    finally:
        stop_mount(mount)


def _fsync(fd: int):
    try:
        return os.fsync(fd)
    except OSError as exc:
        return exc


# -- C2, C3, C4 under real framework save patterns ----------------------------------
def test_C2_C3_dcp_marker_never_before_its_data(m):
    import torch.distributed.checkpoint as dcp

    def check(snap):
        bad = []
        for p in snap:
            if p.endswith("/.metadata"):
                d = p.rsplit("/", 1)[0]
                if f"{d}/__0_0.distcp" not in snap:
                    bad.append(f"{p} visible before its data")
        # (.metadata.tmp may show briefly if its turn comes before DCP renames
        # it, as C4 allows; that it never does when renamed first is tested below.)
        return bad

    with StoreWatcher(m.store, check) as w:
        for step in range(5):
            sd = {"w": torch.full((256, 1024), float(step)), "step": torch.tensor(step)}
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(m.path(f"step-{step}"))))
        r = umount(m)
        assert r.returncode == 0, r.stderr
    assert not w.violations, w.violations[:5]
    assert verify_store(m.store).clean
    files = store_files(m.store)
    assert {f"step-{s}/.metadata" for s in range(5)} <= set(files)
    assert not [p for p in files if p.endswith(".tmp")]


def test_C3_C4_orbax_style_tmp_dir_rename_and_commit_marker(m):
    markers_seen: set[str] = set()

    def check(snap):
        bad = []
        for p in snap:
            if "orbax-checkpoint-tmp" in p and p.endswith("commit_success.txt"):
                bad.append(f"marker under a temp name: {p}")
            # When a marker first appears its data must be there (a later
            # rmtree deletes data first, as the mount did: that is allowed).
            if p.endswith("/commit_success.txt") and p not in markers_seen:
                markers_seen.add(p)
                d = p.rsplit("/", 1)[0]
                for part in ("params.bin", "opt.bin"):
                    if f"{d}/{part}" not in snap:
                        bad.append(f"{p} visible before {d}/{part}")
        return bad

    with StoreWatcher(m.store, check) as w:
        for step in range(6):
            tmp = m.path(f"{step}.orbax-checkpoint-tmp-{step * 7}")
            tmp.mkdir()
            (tmp / "params.bin").write_bytes(os.urandom(300_000))
            (tmp / "opt.bin").write_bytes(os.urandom(200_000))
            os.rename(tmp, m.path(str(step)))
            m.path(str(step), "commit_success.txt").write_text("ok")
            if step >= 2:
                shutil.rmtree(m.path(str(step - 2)))
        assert umount(m).returncode == 0
    assert not w.violations, w.violations[:5]
    assert sorted(p for p in store_files(m.store)) == [f"{s}/{n}" for s in (4, 5) for n in ("commit_success.txt", "opt.bin", "params.bin")]
    assert not any("orbax-checkpoint-tmp" in name for name in os.listdir(m.store))


def test_C3_megatron_tracker_rewrite_never_ahead_of_data(m):
    def check(snap):
        tracker = snap.get("latest_checkpointed_iteration.txt")
        if tracker is None:
            return []
        it = int(tracker)
        need = [f"iter_{it:07d}/mp_rank_0{r}/model_optim_rng.pt" for r in range(2)]
        return [f"tracker says {it} but {p} is missing" for p in need if p not in snap]

    with StoreWatcher(m.store, check) as w:
        for it in (100, 200, 300, 400):
            for r in range(2):
                d = m.path(f"iter_{it:07d}", f"mp_rank_0{r}")
                d.mkdir(parents=True)
                torch.save({"w": torch.randn(64, 1024)}, d / "model_optim_rng.pt")
            m.path("latest_checkpointed_iteration.txt").write_text(str(it))
        assert umount(m).returncode == 0
    assert not w.violations, w.violations[:5]
    assert store_files(m.store)["latest_checkpointed_iteration.txt"] == b"400"


def test_C3_hf_rotation_old_checkpoint_removed_only_after_new_one_is_in(m):
    def complete(n: int) -> bool:
        return all((m.store / f"checkpoint-{n}" / f).exists() for f in ("model.safetensors", "trainer_state.json"))

    violations: list[str] = []
    seen: set[int] = set()
    stop = threading.Event()

    def probe():
        # Probe "n gone" first, then "n+2 complete": checkpoints 3 and 4 only
        # grow in this test, so seeing n+2 incomplete after n is gone proves
        # the store showed the removal before the newer checkpoint was in.
        while not stop.is_set():
            for n in (1, 2):
                if complete(n):
                    seen.add(n)
                elif n in seen and not (m.store / f"checkpoint-{n}").exists() and not complete(n + 2):
                    violations.append(f"checkpoint-{n} removed before checkpoint-{n + 2} was in")
            time.sleep(0.002)

    t = threading.Thread(target=probe)
    t.start()
    try:
        with StoreWatcher(m.store) as w:
            for n in range(1, 5):
                d = m.path(f"checkpoint-{n}")
                d.mkdir()
                (d / "model.safetensors").write_bytes(os.urandom(2_000_000))
                (d / "trainer_state.json").write_text(f'{{"step": {n}}}')
                if n > 2:
                    shutil.rmtree(m.path(f"checkpoint-{n - 2}"))
            assert umount(m).returncode == 0
    finally:
        stop.set()
        t.join()
    assert not w.violations, w.violations[:5]
    assert not violations, violations[:3]
    assert sorted(store_files(m.store)) == [f"checkpoint-{n}/{f}" for n in (3, 4) for f in ("model.safetensors", "trainer_state.json")]


def test_C4_temp_names_renamed_before_their_turn_never_reach_the_store(m):
    m.allowed_log_errors += RETRY_LOG
    big = 1 << 20  # staged ahead: the outage holds their turns back until after the renames
    with StoreWatcher(m.store, lambda snap: [p for p in snap if "tmp" in p]) as w:
        with store_outage(m.store):
            m.path(".metadata.tmp").write_bytes(b"meta" * big)
            os.replace(m.path(".metadata.tmp"), m.path(".metadata"))
            tmpd = m.path("tmp-checkpoint-5")
            tmpd.mkdir()
            (tmpd / "model.bin").write_bytes(b"m" * big)
            os.rename(tmpd, m.path("checkpoint-5"))
            m.path("tmpgone").write_bytes(b"deleted before its turn")
            m.path("tmpgone").unlink()
        wait_store_matches(m.store, {".metadata": b"meta" * big, "checkpoint-5/model.bin": b"m" * big})
    assert not w.violations, w.violations


# -- C5 -------------------------------------------------------------------------------
def test_C5_store_down_then_back_the_queue_drains_by_itself(m):
    m.allowed_log_errors += RETRY_LOG
    with store_outage(m.store):
        for i in range(5):
            m.path(f"f{i}").write_bytes(bytes([i]) * 10_000)
        time.sleep(2)  # several failed tries
        assert store_files(m.store) == {}
        assert "failed (try" in m.log_text()
    wait_store_matches(m.store, {f"f{i}": bytes([i]) * 10_000 for i in range(5)})
    assert verify_store(m.store).clean


def test_C5_umount_reports_what_could_not_be_published(tmp_path):
    mount = start_mount(tmp_path, extra=("--drain-timeout", "2"))
    mount.allowed_log_errors += RETRY_LOG
    try:
        with store_outage(mount.store):
            mount.path("precious.pt").write_bytes(b"p" * 1000)
            r = umount(mount)
        assert r.returncode != 0
        assert "precious.pt" in r.stderr and "NOT published" in r.stderr
        assert not is_mounted(mount.mountpoint)
    finally:
        stop_mount(mount)


def test_C5_sigterm_drains_before_exit(m):
    for i in range(20):
        m.path(f"shard{i}").write_bytes(os.urandom(200_000))
    m.proc.send_signal(signal.SIGTERM)
    assert m.proc.wait(timeout=120) == 0
    assert len(store_files(m.store)) == 20 and verify_store(m.store).clean


def test_C5_files_still_open_at_unmount_are_sealed_and_published(m):
    f = open(m.path("open.log"), "wb")
    f.write(b"written, never closed")
    f.flush()
    try:
        r = umount(m)
        assert r.returncode == 0, r.stderr
    finally:
        with contextlib.suppress(OSError):  # the daemon is gone: ENOTCONN
            f.close()
    assert store_files(m.store) == {"open.log": b"written, never closed"}


# -- C6 -------------------------------------------------------------------------------
def test_C6_checksums_recorded_and_corruption_reads_as_eio(tmp_path):
    mount = start_mount(tmp_path)
    try:
        mount.path("good.pt").write_bytes(b"g" * 50_000)
        mount.path("bad.pt").write_bytes(b"b" * 50_000)
        assert umount(mount).returncode == 0
    finally:
        stop_mount(mount)
    report = verify_store(mount.store)
    assert sorted(report.ok) == ["bad.pt", "good.pt"] and report.clean
    (mount.store / "bad.pt").write_bytes(b"x" * 50_000)  # bit rot, same size
    assert [p for p, _ in verify_store(mount.store).corrupt] == ["bad.pt"]
    again = start_mount(tmp_path, extra=("--log-level", "DEBUG"))
    again.allowed_log_errors.append("checksum mismatch")
    try:
        assert again.path("good.pt").read_bytes() == b"g" * 50_000
        with pytest.raises(OSError) as e:
            again.path("bad.pt").read_bytes()
        assert e.value.errno == 5  # EIO, never silent
        assert " answered EIO: " in again.log_text() and "checksum mismatch" in again.log_text()  # each EIO answer says why
    finally:
        stop_mount(again)


def test_C6_a_files_first_mib_is_served_once_it_verifies_and_rot_past_it_reads_as_eio(tmp_path):
    """After a restart, a reader's first bytes of a file (a header) are
    served once the file's first MiB verifies against its record, not
    the whole block around it: a file rotten at 2 MiB in the store still
    gives its first bytes, and EIO past its first MiB. Rot within the
    first MiB is EIO at the first byte."""
    data = os.urandom(20 << 20)
    mount = start_mount(tmp_path)
    try:
        for name in ("lead-sound.bin", "lead-rotten.bin"):
            mount.path(name).write_bytes(data)
        assert umount(mount).returncode == 0
    finally:
        stop_mount(mount)
    for name, at in (("lead-sound.bin", 2 << 20), ("lead-rotten.bin", 1000)):
        with open(mount.store / name, "r+b") as f:  # bit rot, same size
            f.seek(at)
            f.write(bytes([data[at] ^ 1]))
    again = start_mount(tmp_path)
    again.allowed_log_errors.append("checksum mismatch")
    try:
        drop_caches()
        with open(again.path("lead-sound.bin"), "rb", buffering=0) as f:
            assert f.read(4096) == data[:4096]
            f.seek((1 << 20) - 100)
            assert f.read(100) == data[(1 << 20) - 100 : 1 << 20]
            with pytest.raises(OSError) as e:
                f.read(1 << 20)
            assert e.value.errno == 5
        with open(again.path("lead-rotten.bin"), "rb", buffering=0) as f, pytest.raises(OSError) as e:
            f.read(16)
        assert e.value.errno == 5 and "checksum mismatch in the first" in again.log_text()
    finally:
        stop_mount(again)


# -- C7 -------------------------------------------------------------------------------
def test_C7_budget_smaller_than_the_checkpoints_saves_succeed_nothing_lost(tmp_path):
    mount = start_mount(tmp_path, memory_limit="48M")
    try:
        payloads = {f"ckpt/shard{i}.pt": os.urandom(12 << 20) for i in range(8)}  # 96 MiB through 48 MiB
        mount.path("ckpt").mkdir()
        for p, data in payloads.items():
            mount.path(p).write_bytes(data)
        drop_caches()
        for p, data in payloads.items():  # evicted ones come back from the store, verified
            assert mount.path(p).read_bytes() == data
        assert umount(mount).returncode == 0
    finally:
        stop_mount(mount)
    assert store_files(mount.store) == payloads


def test_C7_a_save_larger_than_the_whole_budget_succeeds_and_is_published_whole(tmp_path):
    mount = start_mount(tmp_path, memory_limit="32M")
    mount.allowed_log_errors += ["RAM budget"]
    sd = {f"layer{i}": torch.randn(5 << 20) for i in range(5)}  # 100 MiB through 32 MiB
    try:
        torch.save(sd, mount.path("model.pt"))
        assert "RAM budget full" in mount.log_text()
        loaded = torch.load(mount.path("model.pt"))
        assert all(torch.equal(loaded[k], sd[k]) for k in sd)
        r = umount(mount)
        assert r.returncode == 0, r.stderr
    finally:
        stop_mount(mount)
    assert verify_store(mount.store).ok == ["model.pt"]
    loaded = torch.load(mount.store / "model.pt")
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)


def test_C7_a_spill_directory_that_fills_up_fails_the_write_and_says_why(tmp_path):
    """The disk under the spill directory fills: the write that could not
    continue there fails (ENOSPC, as on a full disk) and the log says why
    and what to do, instead of nothing; what was written stays readable."""
    spill = tmp_path / "spill"
    spill.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(spill)], check=True)
    try:
        mount = start_mount(tmp_path, memory_limit="16M", extra=("--spill-dir", str(spill)))
        mount.allowed_log_errors += ["RAM budget", "cannot continue big.bin"]
        try:
            with pytest.raises(OSError) as got, open(mount.path("big.bin"), "wb") as f:
                for _ in range(64):
                    f.write(b"x" * (1 << 20))
            assert got.value.errno == errno.ENOSPC
            assert "cannot continue big.bin on disk" in mount.log_text() and "No space left on device" in mount.log_text()
            mount.path("small").write_bytes(b"still fine")
            assert mount.path("small").read_bytes() == b"still fine"
        finally:
            stop_mount(mount)
    finally:
        subprocess.run(["umount", "-l", str(spill)], check=True)


def test_C7_a_full_spill_directory_waits_for_write_back_to_free_it(tmp_path):
    """RAM full, and the spill directory's disk full of a file still waiting
    for the store (down): the next big write used to fail with ENOSPC. It
    waits instead (store speed, C7): once the store is back, the spilled
    file is published and evicted, its room goes to the writer, and nothing
    fails."""
    spill = tmp_path / "spill"
    spill.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(spill)], check=True)
    first, second = os.urandom(24 << 20), os.urandom(24 << 20)
    try:
        mount = start_mount(tmp_path, memory_limit="16M", extra=("--spill-dir", str(spill)))
        mount.allowed_log_errors += ["RAM budget", "spill directory", *RETRY_LOG]
        try:
            failed: list[BaseException] = []

            def save_second() -> None:
                try:
                    mount.path("second.bin").write_bytes(second)
                except BaseException as exc:
                    failed.append(exc)

            with store_outage(mount.store):
                mount.path("first.bin").write_bytes(first)  # spilled whole: 24 of the 40 MiB
                saver = threading.Thread(target=save_second)
                saver.start()
                wait_until(lambda: "spill directory" in mount.log_text() and "is full" in mount.log_text(), 30, "the writer waiting")
                assert saver.is_alive() and not failed
            saver.join(120)
            assert not saver.is_alive() and not failed, failed
            wait_store_matches(mount.store, {"first.bin": first, "second.bin": second}, timeout=120)
            assert mount.path("second.bin").read_bytes() == second
            assert mount.path("first.bin").read_bytes() == first  # evicted from the spill directory: loaded back, verified
        finally:
            stop_mount(mount)
    finally:
        subprocess.run(["umount", "-l", str(spill)], check=True)


def test_C7_budget_exhausted_by_unpublished_data_while_the_store_is_down(tmp_path):
    mount = start_mount(tmp_path, memory_limit="48M")
    mount.allowed_log_errors += ["RAM budget", *RETRY_LOG]
    payloads = {f"shard{i}.bin": os.urandom(16 << 20) for i in range(5)}
    try:
        with store_outage(mount.store):
            for p, data in payloads.items():  # 80 MiB of unpublishable data into 48 MiB
                mount.path(p).write_bytes(data)
            assert store_files(mount.store) == {}
        wait_store_matches(mount.store, payloads, timeout=120)
        for p, data in payloads.items():
            assert mount.path(p).read_bytes() == data
    finally:
        stop_mount(mount)
    assert verify_store(mount.store).clean


# -- C8 -------------------------------------------------------------------------------
def test_C8_store_holds_plain_files_readable_without_ckptfs(m):
    sd = {"w": torch.randn(100, 100)}
    m.path("run").mkdir()
    torch.save(sd, m.path("run", "model.pt"))
    assert umount(m).returncode == 0
    loaded = torch.load(m.store / "run" / "model.pt")  # straight from the store
    assert torch.equal(loaded["w"], sd["w"])
    assert sorted(os.listdir(m.store)) == [".ckptfs", "run"]


def test_C5_a_file_made_by_mknod_is_published_and_comes_back(tmp_path):
    """mknod(2) of a regular file: no handle of it ever closes, yet it is a
    file like any other (it used to stay dirty forever while flush and
    unmount said everything was published, and a remount lost it)."""
    first = start_mount(tmp_path)
    try:
        os.mknod(first.path("made"), 0o600 | 0o100000)
        os.mknod(first.path("filled"), 0o644 | 0o100000)
        first.path("filled").write_bytes(b"x" * 10)
        assert run_cli("flush", str(first.mountpoint)).returncode == 0
        assert sorted(store_files(first.store)) == ["filled", "made"]
        assert (first.store / "filled").read_bytes() == b"x" * 10
        r = run_cli("status", str(first.mountpoint), "--json")
        assert json.loads(r.stdout)["totals"]["by_state"]["dirty"]["files"] == 0, r.stdout
        assert umount(first).returncode == 0
    finally:
        stop_mount(first)
    second = start_mount(tmp_path)
    try:
        assert second.path("made").read_bytes() == b"" and (second.path("made").stat().st_mode & 0o7777) == 0o600
        assert second.path("filled").read_bytes() == b"x" * 10
    finally:
        stop_mount(second)


# -- C9 -------------------------------------------------------------------------------
def test_C9_remount_shows_files_at_once_and_loads_verified(tmp_path):
    first = start_mount(tmp_path)
    sd = {"w": torch.randn(512, 512)}
    try:
        first.path("ckpt").mkdir()
        torch.save(sd, first.path("ckpt", "model.pt"))
        os.symlink("ckpt/model.pt", first.path("last.pt"))
        assert umount(first).returncode == 0
    finally:
        stop_mount(first)
    second = start_mount(tmp_path)
    try:
        assert sorted(os.listdir(second.mountpoint)) == ["ckpt", "last.pt"]
        assert second.path("ckpt", "model.pt").stat().st_size == (first.store / "ckpt" / "model.pt").stat().st_size
        assert torch.equal(torch.load(second.path("last.pt"))["w"], sd["w"])
        wait_until(lambda: "loaded ckpt/model.pt from the store" in second.log_text() and "verified" in second.log_text(), 10,
                   "the load logged")  # the bytes are served before the load says so
    finally:
        stop_mount(second)


def test_C9_an_empty_file_restored_from_the_store_is_rewritten_without_its_old_bytes(tmp_path):
    """An O_TRUNC open replaces a file's bytes: a write after it never needs
    the old ones. For an empty file whose bytes were not in RAM (restored
    from the store, or in a cluster another node's file lost with it), the
    write loaded them first, and failed with EIO where they could not be
    loaded (here: gone from the store under the mount)."""
    first = start_mount(tmp_path)
    try:
        first.path("empty").write_bytes(b"")
        assert umount(first).returncode == 0
    finally:
        stop_mount(first)
    second = start_mount(tmp_path)
    try:
        (second.store / "empty").unlink()
        with open(second.path("empty"), "wb") as f:
            f.write(b"rewritten")
        assert second.path("empty").read_bytes() == b"rewritten"
        wait_store_matches(second.store, {"empty": b"rewritten"})
    finally:
        stop_mount(second)


def test_kill9_during_writeback_leaves_only_whole_verified_files(tmp_path):
    mount = start_mount(tmp_path)
    try:
        writer = subprocess.Popen([sys.executable, "-c", f"""
import os
for i in range(400):
    with open(os.path.join({str(mount.mountpoint)!r}, f"f{{i:03d}}.bin"), "wb") as f:
        f.write(os.urandom(300_000))
"""], stderr=subprocess.DEVNULL)
        wait_until(lambda: len(store_files(mount.store)) >= 20, 60, "some files published")
        os.kill(mount.pid, signal.SIGKILL)
        writer.wait(timeout=60)
    finally:
        stop_mount(mount)
    report = verify_store(mount.store)
    assert report.ok and not report.corrupt and not report.extra, (report.corrupt, report.extra)
    again = start_mount(tmp_path)
    try:
        names = sorted(os.listdir(again.mountpoint))
        assert names == sorted(report.ok)
        assert all(len(again.path(n).read_bytes()) == 300_000 for n in names[:10])
    finally:
        stop_mount(again)
