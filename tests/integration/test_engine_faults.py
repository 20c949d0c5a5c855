"""The write-back engine's promise on real mounts, in the cases where the
first engine broke it: directory commits, rotation through an outage,
exchanges, hard links, truncates of evicted files, namespace changes left at
unmount, names a store cannot take, and bytes that changed in the store."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from ckptfs.client import Client, FlushIncomplete
from tests.crashpoints import checkpoint_workload, consistent
from tests.mountutil import drop_caches, limit_open_files, run_cli, start_mount, stop_mount
from tests.storeutil import StoreWatcher, store_files, store_outage, verify_store, wait_store_matches, wait_until

RETRY_LOG = ("failed (try", "retrying", "NOT PUBLISHED", "not published", "heartbeat", "failed for good", "parked",
             "cannot be applied", "is recorded but missing")


@pytest.fixture
def m(fresh_mount):
    return fresh_mount


def umount(mount, *args: str):
    return run_cli("umount", str(mount.mountpoint), *args, timeout=300)


def test_orbax_directory_commit_appears_in_the_store_as_a_unit(m):
    """Orbax on a local path: files into `N.orbax-checkpoint-tmp-*`, the
    directory renamed to `N`, then `N/commit_success.txt`. A reader of the
    store never sees `N/` with only part of its files, nor the marker early."""
    members = ("manifest.ocdbt", "_METADATA", "d/0", "d/1")

    def check(snap: dict) -> list[str]:
        out = []
        for step in range(1, 6):
            have = {p.split("/", 1)[1] for p in snap if p.startswith(f"{step}/")}
            if have and not set(members) <= have:
                out.append(f"{step}/ visible with only {sorted(have)}")
        return out

    with StoreWatcher(m.store, check) as w:
        for step in range(1, 6):
            tmp = m.path(f"{step}.orbax-checkpoint-tmp-1700000000")
            (tmp / "d").mkdir(parents=True)
            for name in members:
                with open(tmp / name, "wb") as f:
                    f.write(os.urandom(300_000))
                    f.flush()
                    os.fsync(f.fileno())
            os.rename(tmp, m.path(str(step)))
            m.path(str(step), "commit_success.txt").write_text("ok")
        assert umount(m).returncode == 0
    assert w.polls > 10
    assert not w.violations, w.violations[:5]
    assert sorted(store_files(m.store)) == sorted(f"{s}/{n}" for s in range(1, 6) for n in (*members, "commit_success.txt"))
    assert verify_store(m.store).clean


def test_rotation_through_an_outage_always_leaves_a_complete_checkpoint(tmp_path):
    """keep-2 rotation; during an outage checkpoints 3..6 are saved and 1..4
    deleted (3 and 4 never reach the store). Once the store held a complete
    checkpoint it must hold one at every moment after."""
    mount = start_mount(tmp_path)
    mount.allowed_log_errors += RETRY_LOG
    files = ("model.safetensors", "optimizer.pt", "trainer_state.json")
    ever = threading.Event()

    def check(snap: dict) -> list[str]:
        names = {p.split("/")[0] for p in snap}
        complete = [n for n in names if all(f"{n}/{f}" in snap for f in files)]
        if complete:
            ever.set()
            return []
        return ["no complete checkpoint in the store"] if ever.is_set() else []

    def save(n: int) -> None:
        d = mount.path(f"checkpoint-{n}")
        d.mkdir()
        for f in files:
            (d / f).write_bytes(os.urandom(200_000))

    try:
        with StoreWatcher(mount.store, check) as w:
            save(1)
            save(2)
            wait_until(lambda: len(store_files(mount.store)) == 6, what="checkpoints 1 and 2 in the store")
            with store_outage(mount.store):
                for n in range(3, 7):
                    save(n)
                    shutil.rmtree(mount.path(f"checkpoint-{n - 2}"))
                time.sleep(2)
            assert umount(mount).returncode == 0
        assert not w.violations, w.violations[:3]
        assert sorted(store_files(mount.store)) == [f"checkpoint-{n}/{f}" for n in (5, 6) for f in files]
        assert verify_store(mount.store).clean
    finally:
        stop_mount(mount)


def _renameat2(a, b, flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def test_exchange_hard_links_and_truncating_an_evicted_file(m):
    m.path("a").write_bytes(b"A" * 1000)
    m.path("b").write_bytes(b"B" * 10)
    os.link(m.path("a"), m.path("a.link"))
    assert run_cli("flush", str(m.mountpoint)).returncode == 0
    assert store_files(m.store) == {"a": b"A" * 1000, "b": b"B" * 10, "a.link": b"A" * 1000}
    _renameat2(m.path("a"), m.path("b"), 2)  # RENAME_EXCHANGE
    assert run_cli("flush", str(m.mountpoint)).returncode == 0
    assert store_files(m.store) == {"a": b"B" * 10, "b": b"A" * 1000, "a.link": b"A" * 1000}
    assert run_cli("evict", str(m.mountpoint)).returncode == 0
    drop_caches()
    assert m.path("a").read_bytes() == b"B" * 10 and m.path("b").read_bytes() == b"A" * 1000
    m.path("c").write_bytes(b"C")
    os.rename(m.path("c"), m.path("b"))  # over a name whose file has another link
    assert run_cli("flush", str(m.mountpoint)).returncode == 0
    assert store_files(m.store) == {"a": b"B" * 10, "b": b"C", "a.link": b"A" * 1000}
    assert run_cli("evict", str(m.mountpoint)).returncode == 0
    with open(m.path("a.link"), "wb"):  # O_TRUNC of an evicted file: a new, empty generation
        pass
    os.truncate(m.path("a"), 0)
    assert run_cli("flush", str(m.mountpoint)).returncode == 0
    assert store_files(m.store) == {"a": b"", "b": b"C", "a.link": b""}
    assert verify_store(m.store).clean


def test_renames_and_removals_left_at_unmount_are_reported(tmp_path):
    mount = start_mount(tmp_path, extra=("--drain-timeout", "2"))
    mount.allowed_log_errors += RETRY_LOG
    try:
        mount.path("published.pt").write_bytes(b"p" * 1000)
        mount.path("old.pt").write_bytes(b"o")
        wait_store_matches(mount.store, {"published.pt": b"p" * 1000, "old.pt": b"o"})
        with store_outage(mount.store):
            os.rename(mount.path("published.pt"), mount.path("renamed.pt"))
            os.unlink(mount.path("old.pt"))
            r = umount(mount)
        assert r.returncode != 0, r.stdout + r.stderr
        assert "published.pt" in r.stderr and "old.pt" in r.stderr
    finally:
        stop_mount(mount)


def test_a_name_the_store_cannot_take_is_parked_and_does_not_block_the_rest(tmp_path):
    """Where the file's directory goes, the (local) store has a symlink,
    which ckptfs never follows. The file is parked (shown as failed, with its
    error), files after it are published, and unmount says it was not
    published."""
    store = tmp_path / "store"
    store.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (store / "deep").symlink_to(elsewhere)
    mount = start_mount(tmp_path)
    mount.allowed_log_errors += [*RETRY_LOG, "symlink in the store", "cannot be applied"]
    try:
        (mount.path("deep")).mkdir()
        mount.path("deep", "model.pt").write_bytes(b"m" * 100)
        mount.path("after.pt").write_bytes(b"a" * 100)
        wait_until(lambda: (store / "after.pt").exists(), timeout=60, what="the file after the parked one")

        def files() -> dict:
            r = run_cli("status", str(mount.mountpoint), "--files", "--json")
            return {f["path"].rsplit("/", 1)[-1]: f for f in json.loads(r.stdout)["files"]}

        wait_until(lambda: files()["model.pt"]["error"].startswith("parked"), timeout=60, what="the file to be parked")
        files = files()
        assert files["model.pt"]["state"] == "failed" and "symlink" in files["model.pt"]["error"]
        assert files["after.pt"]["state"] == "published"
        # flush with no timeout: what is left can never be published as it is, so it says so and ends (a traceback before)
        r = run_cli("flush", str(mount.mountpoint), timeout=60)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "never published as they are (parked" in r.stderr and "model.pt" in r.stderr
        with pytest.raises(FlushIncomplete) as got:
            Client(mount.mountpoint).flush()
        # the directory the store could not make (a symlink there), and the file in it
        assert not got.value.timed_out and [(f["path"], f["state"]) for f in got.value.left] == [("deep", "mkdir not applied"),
                                                                                               ("deep/model.pt", "parked")]
        r = umount(mount)
        assert r.returncode != 0 and "model.pt" in r.stderr
        assert list(elsewhere.iterdir()) == []
    finally:
        stop_mount(mount)


@pytest.mark.parametrize("own", [False, True], ids=["no --marker", "--marker done"])
def test_a_marker_of_the_users_own_waits_for_a_parked_file_in_its_directory(tmp_path, own):
    """`--marker done`: `ck/done` is a completion marker, as `.metadata` is.
    A file in its directory tree can never be published (parked: the store
    has a symlink where its directory goes), so `done` must not reach the
    store, while files elsewhere do; once the parked file is deleted it is
    published. Without the option `done` is data like any other file."""
    store = tmp_path / "store"
    (store / "ck").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (store / "ck" / "sub").symlink_to(elsewhere)
    mount = start_mount(tmp_path, extra=("--marker", "done") if own else ())
    mount.allowed_log_errors += [*RETRY_LOG, "symlink in the store", "cannot be applied"]
    try:
        mount.path("ck", "sub").mkdir()
        mount.path("ck", "sub", "shard").write_bytes(b"s" * 100)
        mount.path("ck", "done").write_text("ok")
        mount.path("other").mkdir()
        mount.path("other", "after.pt").write_bytes(b"a" * 100)
        wait_until(lambda: (store / "other" / "after.pt").exists(), timeout=60, what="a file in another directory")
        wait_until(lambda: "parked" in run_cli("status", str(mount.mountpoint), "--files", "--json").stdout, timeout=60,
                   what="the shard to be parked")
        if not own:
            wait_until(lambda: (store / "ck" / "done").exists(), timeout=60, what="done, a plain file")
            return
        time.sleep(1)  # write-back passed it long ago
        assert not (store / "ck" / "done").exists()
        r = run_cli("status", str(mount.mountpoint), "--files", "--json")
        row = {f["path"]: f for f in json.loads(r.stdout)["files"]}["ck/done"]
        assert row["state"] != "published" and row["error"].startswith("held back: ck/sub/shard"), row
        r = run_cli("flush", str(mount.mountpoint), timeout=60)  # stuck, and says why
        assert r.returncode == 1 and "ck/done: staged, 2 B (held back: ck/sub/shard, in its directory tree, failed for good" in r.stderr, r.stderr
        mount.path("ck", "sub", "shard").unlink()
        wait_until(lambda: (store / "ck" / "done").exists(), timeout=60, what="done, once the parked file is deleted")
        assert "also completion markers: done" in mount.log_text()
        r = umount(mount)  # the store still differs where the symlink is: said, and not published
        assert r.returncode == 1 and "ck/sub" in r.stderr and "done" not in r.stderr, r.stderr
        assert list(elsewhere.iterdir()) == []
    finally:
        stop_mount(mount)


def test_a_path_longer_than_path_max_in_the_store_is_published(tmp_path):
    """The store sits so deep that a file's path there passes PATH_MAX: the
    mount takes it, and so does the store (every store call works relative
    to the directory it acts in)."""
    rel = "/".join(["d" * 200] * 4) + "/model.pt"
    store = tmp_path
    while len(str(store)) + 1 + len(rel) <= 4096:
        store = store / ("s" * 240)
    store.mkdir(parents=True)
    mount = start_mount(tmp_path, extra=("--store", str(store)))
    mount.store = store
    try:
        deep = mount.mountpoint
        for _ in range(4):
            deep = deep / ("d" * 200)
        deep.mkdir(parents=True)
        (deep / "model.pt").write_bytes(b"m" * 100)
        mount.path("after.pt").write_bytes(b"a" * 100)
        assert umount(mount).returncode == 0
        r = run_cli("verify", str(store))
        assert r.returncode == 0 and r.stdout.startswith("2 ok"), r.stdout + r.stderr
    finally:
        stop_mount(mount)


def test_a_tree_deeper_than_python_recursion_is_published_and_comes_back(tmp_path):
    """1,500 directories deep (one `mkdir -p`; Python's recursion limit is
    1,000): every mkdir succeeds, the file is published under its final name
    after its top directory is renamed, and a remount shows it."""
    try:
        _deep_tree_round_trip(tmp_path, 1500)
    finally:
        subprocess.run(["rm", "-rf", str(tmp_path / "store")], check=False)  # pytest's own cleanup of old runs recurses: too deep for it


def test_a_store_directory_of_hundreds_of_directories_needs_few_descriptors(tmp_path):
    """The store walk held a descriptor for every subdirectory of the
    directory it listed: 1,500 step directories failed every restart of a
    daemon limited to 1,024 descriptors (EMFILE: the mount failed), and
    `verify` too; reading every record and a group commit held one for
    every directory they went to. Now a walk holds one per level of depth,
    the others the last few. (700 directories here: well past the daemon's
    256 descriptors.)"""
    mount = start_mount(tmp_path, open_files=256)
    try:
        for i in range(700):
            mount.path(f"step-{i}").mkdir()
            mount.path(f"step-{i}", "model.pt").write_bytes(b"%d" % i)
        assert umount(mount).returncode == 0
    finally:
        stop_mount(mount)
    again = start_mount(tmp_path, open_files=256)
    try:
        assert sorted(p.name for p in again.mountpoint.iterdir()) == sorted(f"step-{i}" for i in range(700))
        assert again.path("step-699", "model.pt").read_bytes() == b"699"
        assert umount(again).returncode == 0
        assert again.unexpected_log_errors() == []
    finally:
        stop_mount(again)
    r = subprocess.run([sys.executable, "-m", "ckptfs.tools.cli", "verify", str(mount.store)], capture_output=True, text=True,
                       preexec_fn=lambda: limit_open_files(256))
    assert r.returncode == 0 and r.stdout.startswith("700 ok"), r.stdout + r.stderr


def _deep_tree_round_trip(tmp_path, depth: int) -> None:
    mount = start_mount(tmp_path)
    try:
        subprocess.run(["mkdir", "-p", "/".join(["a"] * depth)], cwd=mount.mountpoint, check=True)
        deep = "/".join(["a"] * (depth - 1))
        top = os.open(mount.mountpoint, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fd = os.open(deep, os.O_RDONLY | os.O_DIRECTORY, dir_fd=top)
        finally:
            os.close(top)
        try:
            with open(os.open("a/model.pt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "wb") as f:
                f.write(b"m" * 100)
        finally:
            os.close(fd)
        mount.path("a").rename(mount.path("b"))
        assert umount(mount).returncode == 0  # 0: everything published
        assert mount.unexpected_log_errors() == []
        r = run_cli("verify", str(mount.store))
        assert r.returncode == 0 and r.stdout.startswith("1 ok"), r.stdout + r.stderr
    finally:
        stop_mount(mount)
    again = start_mount(tmp_path)
    try:
        path = "/".join(["b"] + ["a"] * (depth - 1)) + "/model.pt"
        assert subprocess.run(["cat", path], cwd=again.mountpoint, capture_output=True, check=True).stdout == b"m" * 100
        assert again.unexpected_log_errors() == []
    finally:
        stop_mount(again)


def test_bytes_changed_in_the_store_are_refused_after_a_restart(tmp_path):
    mount = start_mount(tmp_path)
    mount.path("model.pt").write_bytes(b"w" * 10_000)
    assert umount(mount).returncode == 0
    stop_mount(mount)
    with open(mount.store / "model.pt", "ab") as f:
        f.write(b"appended")  # the old bytes are still a prefix
    again = start_mount(tmp_path)
    again.allowed_log_errors += ("checksum mismatch",)
    try:
        with pytest.raises(OSError) as exc:
            again.path("model.pt").read_bytes()
        assert exc.value.errno == 5  # EIO
        assert "checksum mismatch" in again.log_text()
    finally:
        stop_mount(again)


def _crash_at(base, n: int, when: str) -> bool:
    """One run of the workload killed -9 at store call `n` (`when`: before or
    after it), then checked after a remount; False: it never got that far."""
    m = start_mount(base, env={"CKPTFS_TEST_CRASH_AT": f"{n}:{when}"})
    m.allowed_log_errors += (*RETRY_LOG, "crash-point test")
    try:
        checkpoint_workload(m)
        died = "crash-point test: SIGKILL" in m.log_text()
        step1_was_complete = all(f"published 1/{name} " in m.log_text() for name in ("a", "b", "c", "commit"))
    finally:
        stop_mount(m)
    if not died:
        return False
    again = start_mount(base)
    again.allowed_log_errors += RETRY_LOG
    try:
        files = store_files(again.store)
        assert not consistent(files, step1_was_complete), (n, when, sorted(files), consistent(files, step1_was_complete))
        report = verify_store(again.store)
        assert report.clean, (n, when, report)
        staging = again.store / ".ckptfs" / "staging"
        litter = [os.path.relpath(os.path.join(d, f), staging) for d, _, fs in os.walk(staging) for f in fs]
        assert litter == [], (n, when, litter)
    finally:
        stop_mount(again)
    return True


def test_kill9_at_every_store_call_leaves_a_verifiable_prefix(tmp_path):
    """kill -9 of the daemon before and after each of its store calls during
    a small checkpoint workload: every time, after a remount the store is a
    consistent prefix, `verify` passes and no staging litter is left. The
    crash points run `at_once` at a time (each daemon on a store of its own:
    most of a run is waiting on processes), until the workload ends before
    its crash point."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    points = ((n, when) for n in range(3, 80) for when in ("before", "after"))  # calls 1-2 (scan, claim) come before the hook
    crashes, ended, running, at_once = 0, False, set(), 3
    with ThreadPoolExecutor(at_once) as pool:
        while True:
            while not ended and len(running) < at_once and (point := next(points, None)) is not None:
                running.add(pool.submit(_crash_at, tmp_path / f"{point[0]}-{point[1]}", *point))
            if not running:
                break
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for f in done:
                if f.result():
                    crashes += 1
                else:
                    ended = True  # the workload ended before this point: so it does before every later one
        if ended:
            assert crashes > 10, f"only {crashes} crash points: the workload makes fewer store calls than expected"
            return
    raise AssertionError("the workload never finished without a crash")


def test_a_truncate_after_the_seal_never_changes_what_is_published(tmp_path):
    """Closed (sealed) while the store is down, then reopened by a writer that
    shrinks it and keeps it open: what reaches the store is the sealed bytes,
    whole, never a truncated version of them that no close ever sealed."""
    mount = start_mount(tmp_path)
    mount.allowed_log_errors += RETRY_LOG
    try:
        sealed = os.urandom(3 << 20)
        with store_outage(mount.store):
            mount.path("model.pt").write_bytes(sealed)
            fd = os.open(mount.path("model.pt"), os.O_WRONLY)
            os.ftruncate(fd, 1000)
        try:
            wait_store_matches(mount.store, {"model.pt": sealed})
            assert verify_store(mount.store).clean
        finally:
            os.close(fd)
        wait_store_matches(mount.store, {"model.pt": sealed[:1000]})
    finally:
        stop_mount(mount)
