"""Cluster mode on real mounts: several daemons on this machine (one per
"node"), one namespace in a real Redis, one local-directory store."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.mountutil import Mount, lazy_unmount, run_cli, start_mount, stop_mount
from tests.ports import free_port
from tests.storeutil import store_files, wait_store_matches, wait_until

VISIBLE_S = 1.0  # the bound the README states for a change on one node to show on the others


@contextmanager
def nodes(tmp_path: Path, redis_db, names: str = "ab", store: Path | None = None, extra: tuple[str, ...] = (),
          per_node: dict[str, tuple[str, ...]] | None = None):
    """Mounts of one cluster, the first to start publishing for it; all stopped at the end, whatever happens."""
    store = store or tmp_path / "store"
    mounts: list[Mount] = []
    try:
        for name in names:
            mounts.append(start_mount(tmp_path / name, store=store,
                                      extra=("--cluster", redis_db.url, "--cluster-password-file", str(redis_db.password_file),
                                             "--node", name, *extra, *(per_node or {}).get(name, ()))))
        yield mounts
    finally:
        for m in reversed(mounts):  # the publishing node (the first) last: the others need not take over
            stop_mount(m)


def _staging_of(store: Path, m: Mount) -> Path:
    """The staging directory of the daemon of mount `m` (its id names its pid)."""
    daemons = store / ".ckptfs" / "daemons"
    wait_until(lambda: any(f"-{m.pid}-" in p.name for p in daemons.iterdir()), 10, "the daemon's heartbeat")
    daemon = next(p.name for p in daemons.iterdir() if f"-{m.pid}-" in p.name)
    return store / ".ckptfs" / "staging" / daemon


@contextmanager
def staging_blocked(store: Path, m: Mount):
    """While inside: node `m` cannot stage anything (a file where its staging directory goes), the others can."""
    staging = _staging_of(store, m)
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    staging.write_bytes(b"blocked")
    try:
        yield
    finally:
        staging.unlink()
    m.allowed_log_errors += ["upload", "publish of"]  # the publishing node stages its small files at publication


def _xattr(path: Path, field: str) -> str:
    got = subprocess.run(["getfattr", "-n", f"user.ckptfs.{field}", "--only-values", str(path)], capture_output=True, text=True)
    return got.stdout.strip()


@contextmanager
def watching(store: Path):
    """What a watcher of the store saw, poll by poll, while inside."""
    seen: list[set[str]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(set(store_files(store)))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield seen
    finally:
        stop.set()
        watcher.join()


def assert_a_single_node_remount_shows(tmp_path: Path, store: Path, want: dict[str, bytes], modes: dict[str, int] | None = None) -> None:
    """A mount of the store alone (no cluster) shows `want` (and `modes`),
    from the manifest index the cluster's last publishing node left, with
    nothing to warn of: no record left out of it, none of a file gone."""
    m = start_mount(tmp_path / "single", store=store)
    try:
        assert store_files(m.mountpoint) == want  # (any tree: the mount has no .ckptfs)
        for name, mode in (modes or {}).items():
            assert stat.S_IMODE(os.stat(m.path(name)).st_mode) == mode, name
        assert m.unexpected_log_errors() == [], m.unexpected_log_errors()
    finally:
        stop_mount(m)


def test_names_and_files_are_shared_and_each_node_reads_the_others_files(tmp_path, redis_db):
    with nodes(tmp_path, redis_db) as (a, b):
        a.path("ckpt").mkdir(mode=0o750)
        a.path("ckpt", "shard-a").write_bytes(b"A" * 300_000)
        os.symlink("shard-a", a.path("ckpt", "link"))
        deadline = time.monotonic() + VISIBLE_S
        while not b.path("ckpt", "link").is_symlink():
            assert time.monotonic() < deadline, "a change on one node is not seen on another within the bound"
            time.sleep(0.02)
        assert sorted(os.listdir(b.path("ckpt"))) == ["link", "shard-a"]
        assert os.stat(b.path("ckpt")).st_mode & 0o7777 == 0o750
        assert os.readlink(b.path("ckpt", "link")) == "shard-a"
        assert b.path("ckpt", "shard-a").read_bytes() == b"A" * 300_000  # from the store, once a published it, verified
        b.path("ckpt", "shard-b").write_bytes(b"B" * 70_000)
        big = os.urandom(72 << 20)
        b.path("ckpt", "optim-b").write_bytes(big)  # staged while written, by b
        os.mknod(b.path("ckpt", "made-b"), 0o644 | 0o100000)  # no handle of it closes: sealed as made
        wait_until(lambda: a.path("ckpt", "shard-b").exists(), VISIBLE_S, "b's file on a")
        assert a.path("ckpt", "shard-b").read_bytes() == b"B" * 70_000
        assert os.stat(a.path("ckpt", "shard-b")).st_ino == os.stat(b.path("ckpt", "shard-b")).st_ino
        wait_store_matches(tmp_path / "store", {"ckpt/shard-a": b"A" * 300_000, "ckpt/shard-b": b"B" * 70_000, "ckpt/optim-b": big,
                                                "ckpt/made-b": b""})
        assert "ckpt/optim-b: staged while it was written" in b.log_text()
        assert a.path("ckpt", "optim-b").read_bytes() == big
        assert "loaded ckpt/shard-a from the store (300000 bytes, verified)" in b.log_text()
        assert "loaded ckpt/shard-b from the store (70000 bytes, verified)" in a.log_text()
        for m in (a, b):
            assert m.unexpected_log_errors() == []


def test_a_file_deleted_on_another_node_while_the_publishing_node_reads_it_stays_readable(tmp_path, redis_db):
    """A process on the publishing node reads a file whose bytes there are
    only in the store (written on another node; loaded, then evicted), and
    the file is deleted on the other node: its reads got EIO once the
    store's copy went. It stays readable until its last close, as on one
    node (a reader on any other node is not known to the publishing node:
    the README says so)."""
    with nodes(tmp_path, redis_db) as (a, b):
        payload = os.urandom(6_000_000)
        b.path("ckpt.bin").write_bytes(payload)
        assert run_cli("flush", str(b.mountpoint), "--cluster").returncode == 0
        with open(a.path("ckpt.bin"), "rb") as f:
            head = f.read(10)
            r = run_cli("evict", str(a.path("ckpt.bin")))
            assert r.returncode == 0 and "evicted 1 file" in r.stdout, r.stdout + r.stderr
            os.unlink(b.path("ckpt.bin"))
            assert run_cli("flush", str(b.mountpoint), "--cluster").returncode == 0  # the store's copy is gone now
            assert "ckpt.bin" not in store_files(tmp_path / "store")
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # the reads reach the daemon
            assert head + f.read() == payload
        for m in (a, b):
            assert m.unexpected_log_errors() == []


def test_a_name_made_on_two_nodes_at_once_is_made_once(tmp_path, redis_db):
    with nodes(tmp_path, redis_db, "abc") as mounts:
        results: dict[str, object] = {}

        def make(m: Mount) -> None:
            try:
                fd = os.open(m.path("latest"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                os.write(fd, m.mountpoint.parent.name.encode())
                os.close(fd)
                results[m.mountpoint.parent.name] = "made"
            except OSError as exc:
                results[m.mountpoint.parent.name] = exc.errno

        threads = [threading.Thread(target=make, args=(m,)) for m in mounts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        made = [n for n, r in results.items() if r == "made"]
        assert len(made) == 1 and sorted(r for r in results.values() if r != "made") == [errno.EEXIST, errno.EEXIST]
        for m in mounts:
            wait_until(lambda m=m: m.path("latest").exists() and m.path("latest").read_bytes() == made[0].encode(), 5,
                       "the one file on every node")
        wait_store_matches(tmp_path / "store", {"latest": made[0].encode()})


def test_a_marker_written_on_one_node_waits_for_the_data_of_every_node(tmp_path, redis_db):
    """C3 across nodes: the DCP pattern. Node b's shard cannot reach the
    store for a while; node a's `.metadata`, written after it, stays out of
    the store until it has, and a watcher never sees it earlier."""
    store = tmp_path / "store"
    with nodes(tmp_path, redis_db) as (a, b):
        a.path("step-1").mkdir()
        with watching(store) as seen:
            with staging_blocked(store, b):
                b.path("step-1", "shard-b.distcp").write_bytes(os.urandom(300_000))  # sealed first
                a.path("step-1", "shard-a.distcp").write_bytes(os.urandom(300_000))
                a.path("step-1", ".metadata").write_bytes(b"the plan")  # written last, on another node
                wait_until(lambda: "step-1/shard-a.distcp" in store_files(store), 10, "a's own shard")
                time.sleep(1.0)
                assert "step-1/.metadata" not in store_files(store), "the marker reached the store before b's shard"
                assert a.path("step-1", "shard-b.distcp").stat().st_size == 300_000
            wait_until(lambda: "step-1/.metadata" in store_files(store), 30, "the marker, once b's shard is in")
        assert set(store_files(store)) == {"step-1/shard-a.distcp", "step-1/shard-b.distcp", "step-1/.metadata"}
        assert all("step-1/shard-b.distcp" in s for s in seen if "step-1/.metadata" in s)


def test_rotation_and_renames_on_one_node_move_every_node_s_files_in_order(tmp_path, redis_db):
    """rmtree of an old checkpoint on node a removes node b's files too, only
    after the newer checkpoint is complete in the store; an Orbax-style
    rename of a tmp directory on a moves b's files with it."""
    store = tmp_path / "store"
    with nodes(tmp_path, redis_db) as (a, b):
        a.path("ckpt-1.orbax-checkpoint-tmp-1").mkdir()
        b.path("ckpt-1.orbax-checkpoint-tmp-1", "b.bin").write_bytes(b"b1" * 1000)
        a.path("ckpt-1.orbax-checkpoint-tmp-1", "a.bin").write_bytes(b"a1" * 1000)
        os.rename(a.path("ckpt-1.orbax-checkpoint-tmp-1"), a.path("ckpt-1"))
        a.path("ckpt-1", "commit_success.txt").write_bytes(b"ok")
        first = {"ckpt-1/a.bin": b"a1" * 1000, "ckpt-1/b.bin": b"b1" * 1000, "ckpt-1/commit_success.txt": b"ok"}
        wait_store_matches(store, first)
        with staging_blocked(store, b):
            a.path("ckpt-2").mkdir()
            b.path("ckpt-2", "b.bin").write_bytes(b"b2" * 1000)
            a.path("ckpt-2", "a.bin").write_bytes(b"a2" * 1000)
            shutil.rmtree(a.path("ckpt-1"))  # rotation, on node a
            time.sleep(1.0)
            files = store_files(store)
            assert "ckpt-1/b.bin" in files and "ckpt-1/a.bin" in files, "the old checkpoint went before the new one was in"
            assert "ckpt-2/b.bin" not in files
            assert not b.path("ckpt-1").exists()
        wait_store_matches(store, {"ckpt-2/a.bin": b"a2" * 1000, "ckpt-2/b.bin": b"b2" * 1000}, 30)
        assert not (store / "ckpt-1").exists()


def test_cluster_status_and_flush(tmp_path, redis_db):
    """`flush --cluster` on a node waits for what another node sealed before
    it; `status --cluster` shows every node, its role and what it has not
    published yet."""
    store = tmp_path / "store"
    with nodes(tmp_path, redis_db) as (a, b):
        r = run_cli("status", str(a.mountpoint), "--cluster", "--json")
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)["cluster"]["nodes"]
        assert [(n["node"], n["publishes"], n["this"], n["gone"]) for n in got if n["node"] in "ab"] in (
            [("a", True, True, False), ("b", False, False, False)], [("b", False, False, False), ("a", True, True, False)])
        with staging_blocked(store, b):
            b.path("x.bin").write_bytes(b"x" * 100_000)
            wait_until(lambda: a.path("x.bin").exists(), VISIBLE_S, "b's file on a")
            r = run_cli("status", str(a.mountpoint), "--cluster", "--json")
            rows = {n["node"]: n for n in json.loads(r.stdout)["cluster"]["nodes"]}
            assert rows["b"]["unpublished_files"] == 1 and rows["b"]["unpublished_bytes"] == 100_000, rows
            assert rows["a"]["unpublished_files"] == 0
            r = run_cli("flush", str(a.mountpoint), "--cluster", "--timeout", "2")
            assert r.returncode == 1 and "x.bin" in r.stderr, r.stderr
            r = run_cli("status", str(b.mountpoint), "--cluster")
            assert r.returncode == 0 and "publishes" in r.stdout and "stages (this node)" in r.stdout, r.stdout
        r = run_cli("flush", str(a.mountpoint), "--cluster", "--timeout", "30")
        assert r.returncode == 0, r.stderr
        assert store_files(store) == {"x.bin": b"x" * 100_000}
        r = run_cli("status", str(a.mountpoint), "--cluster")
        assert r.returncode == 0, r.stderr


def test_cluster_requests_on_a_mount_without_a_cluster_say_so(fresh_mount):
    for args in (("status", "--cluster"), ("flush", "--cluster")):
        r = run_cli(args[0], str(fresh_mount.mountpoint), *args[1:])
        assert r.returncode != 0 and "not in a cluster (mounted without --cluster)" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_a_cluster_restarts_from_the_store(tmp_path, redis_db):
    store = tmp_path / "store"
    with nodes(tmp_path, redis_db) as (a, b):
        b.path("d").mkdir()
        b.path("d", "f").write_bytes(b"kept" * 1000)
        a.path("g").write_bytes(b"also")
        wait_store_matches(store, {"d/f": b"kept" * 1000, "g": b"also"})
    with nodes(tmp_path, redis_db, "ba") as (b, a):  # every daemon gone: the first back starts afresh from the store
        assert sorted(os.listdir(a.mountpoint)) == ["d", "g"]
        assert a.path("d", "f").read_bytes() == b"kept" * 1000
        assert b.path("g").read_bytes() == b"also"


def test_redis_problems_at_mount_are_one_line_errors(tmp_path, redis_db, monkeypatch):
    mp = tmp_path / "mnt"
    mp.mkdir()
    store = str(tmp_path / "store")
    monkeypatch.delenv("CKPTFS_REDIS_PASSWORD", raising=False)
    r = run_cli("mount", str(mp), "--store", store, "--cluster", "redis://127.0.0.1:1/0")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "cannot reach Redis at redis://127.0.0.1:1/0" in r.stderr, r.stderr
    r = run_cli("mount", str(mp), "--store", store, "--cluster", redis_db.url)
    assert r.returncode == 2 and "needs a password" in r.stderr and "Traceback" not in r.stderr, r.stderr
    env = {**os.environ, "CKPTFS_REDIS_PASSWORD": "wrong"}
    r = run_cli("mount", str(mp), "--store", store, "--cluster", redis_db.url, env=env)
    assert r.returncode == 2 and "refused the password" in r.stderr and "wrong" not in r.stderr, r.stderr
    assert not os.path.ismount(mp)


def _torchrun(tmp: Path, n: int, *args: str) -> None:
    script = Path(__file__).parent / "scripts" / "dcp_ranks.py"
    # TMPDIR: torchrun's own log directory (torchelastic_*), which it leaves behind, goes into the test's
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", str(script), *args],
                       capture_output=True, text=True, timeout=240, env={**os.environ, "TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]


def test_torchrun_ranks_save_with_dcp_each_into_its_own_node_and_load_after_crash_and_restart(tmp_path, redis_db):
    """The issue's DCP case: three ranks, each on its own node's mount, one
    checkpoint. The store never shows `.metadata` before every rank's shard;
    every rank loads it back after the trainer dies (daemons alive) and
    after every daemon restarts."""
    pytest.importorskip("torch")
    store = tmp_path / "store"
    shards = {f"dcp/step-1/__{r}_0.distcp" for r in range(3)}
    with nodes(tmp_path, redis_db, "abc") as mounts:
        with watching(store) as seen:
            _torchrun(tmp_path, 3, "save", "1", *(str(m.mountpoint) for m in mounts))
            wait_until(lambda: shards | {"dcp/step-1/.metadata"} <= set(store_files(store)), 60, "the checkpoint in the store")
        with_marker = [s for s in seen if "dcp/step-1/.metadata" in s]
        assert with_marker and all(shards <= s for s in with_marker), "the store showed .metadata before every rank's shard"
        _torchrun(tmp_path, 3, "load", "1", *(str(m.mountpoint) for m in mounts))  # a new job, the daemons alive
    with nodes(tmp_path, redis_db, "cab") as mounts:  # every daemon restarted: from the store
        _torchrun(tmp_path, 3, "load", "1", *(str(m.mountpoint) for m in mounts))


def test_a_node_killed_mid_checkpoint_loses_only_its_unpublished_files_loudly(tmp_path, redis_db):
    """kill -9 of node b while its shard cannot be staged: every other node
    reports the shard lost, the checkpoint's marker is never published, and
    the next checkpoint works."""
    store = tmp_path / "store"
    port = free_port()
    with nodes(tmp_path, redis_db, "abc", per_node={"c": ("--metrics-port", str(port))}) as (a, b, c):
        a.path("step-1").mkdir()
        with staging_blocked(store, b):
            b.path("step-1", "shard-b").write_bytes(b"b" * 100_000)
            a.path("step-1", "shard-a").write_bytes(b"a" * 100_000)
            a.path("step-1", ".metadata").write_bytes(b"plan")
            b.proc.kill()
            b.proc.wait()
        for m in (a, c):
            wait_until(lambda m=m: "LOST step-1/shard-b" in m.log_text(), 20, f"node {m.mountpoint.parent.name} reporting the lost shard")
            m.allowed_log_errors += ["LOST step-1/shard-b", "node b died"]
        for field, value in (("state", "failed"), ("error", "lost: node b died")):
            got = subprocess.run(["getfattr", "-n", f"user.ckptfs.{field}", "--only-values", str(c.path("step-1", "shard-b"))],
                                 capture_output=True, text=True)
            assert got.stdout.startswith(value), got
        r = run_cli("status", str(a.mountpoint), "--cluster", "--json")
        rows = {n["node"]: n for n in json.loads(r.stdout)["cluster"]["nodes"]}
        assert rows["b"]["lost_files"] == 1 and rows["b"]["gone"], rows
        assert json.loads(r.stdout)["totals"]["lost"] == 1
        r = run_cli("status", str(c.mountpoint))
        assert "lost with their node" in r.stdout, r.stdout
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "ckptfs_lost_files 1.0" in metrics, metrics
        a.path("step-2").mkdir()
        c.path("step-2", "shard-c").write_bytes(b"c" * 1000)
        a.path("step-2", ".metadata").write_bytes(b"plan 2")
        wait_until(lambda: "step-2/.metadata" in store_files(store), 20, "the next checkpoint")
        time.sleep(0.5)
        files = store_files(store)
        assert "step-1/.metadata" not in files and "step-1/shard-b" not in files
        assert files["step-1/shard-a"] == b"a" * 100_000 and files["step-2/shard-c"] == b"c" * 1000
        for m in (a, c):
            assert m.unexpected_log_errors() == [], m.unexpected_log_errors()


def test_redis_lost_while_mounted_blocks_changes_for_a_bound_then_eio_and_loses_nothing(tmp_path, redis_db):
    """Redis stops answering (SIGSTOP: a partition). A namespace change and
    a close wait up to the bound (--cluster-patience, 3 s here where 10 s is
    the default), then fail with EIO; the bytes written stay in RAM and
    everything reaches every node and the store once Redis is back."""
    store = tmp_path / "store"
    with nodes(tmp_path, redis_db, extra=("--cluster-patience", "3")) as (a, b):
        a.path("d").mkdir()
        a.path("d", "f").write_bytes(b"v1")
        wait_store_matches(store, {"d/f": b"v1"})
        for m in (a, b):
            m.allowed_log_errors += ["cannot reach the cluster's Redis", "cannot read the cluster's", "cannot give a seal its place",
                                     "Redis for this node's heartbeat", "the cluster's publishing node (a) is not keeping its key",
                                     "lease to publish for the cluster ran out"]
        os.kill(redis_db.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(OSError) as got:
                a.path("d", "new").mkdir()
            assert got.value.errno == errno.EIO
            assert 3 <= time.monotonic() - t0 <= 40, time.monotonic() - t0  # (each Redis call may take up to its 5 s timeout)
            fd = os.open(a.path("d", "f"), os.O_WRONLY | os.O_TRUNC)
            os.write(fd, b"v2, written while Redis was away")
            t0 = time.monotonic()
            with pytest.raises(OSError) as got:
                os.close(fd)  # its seal cannot get its place in the log yet
            assert got.value.errno == errno.EIO
            assert 3 <= time.monotonic() - t0 < 9, time.monotonic() - t0
            assert a.path("d", "f").read_bytes() == b"v2, written while Redis was away"
        finally:
            os.kill(redis_db.proc.pid, signal.SIGCONT)
        wait_store_matches(store, {"d/f": b"v2, written while Redis was away"}, 60)
        wait_until(lambda: b.path("d", "f").read_bytes() == b"v2, written while Redis was away", 10, "the new bytes on b")
        a.path("d", "new").mkdir()
        wait_until(lambda: b.path("d", "new").is_dir(), 10, "a change after the outage")
        # The publishing node's heartbeat lapsed while Redis was away: it takes it up again, and
        # no node takes the pause for a death (nothing lost, nothing stalled).
        wait_until(lambda: json.loads(run_cli("status", str(b.mountpoint), "--json").stdout)["totals"]["stalled"] == "", 15,
                   "publishing going on")
        b.path("d", "after").write_bytes(b"after the outage")
        wait_store_matches(store, {"d/f": b"v2, written while Redis was away", "d/after": b"after the outage"}, 30)
        for m in (a, b):
            assert "LOST" not in m.log_text() and "no longer publishes" not in m.log_text()


def test_sigusr1_names_the_fuse_request_that_waits_and_the_workers_that_wait_for_the_next(tmp_path, redis_db):
    """A task dump (`kill -USR1`) of a mount whose mkdir waits for Redis
    names that request (its lookup first) with its await stack from its handler down, and no
    other: pyfuse3's workers waiting for the next request are counted, not
    listed. Before, each idle worker was listed as a request of one frame
    (trio's lock or wait, awaited by pyfuse3's compiled code), so a dump of
    a mount whose callers the kernel held read as requests stuck in a lock."""
    with nodes(tmp_path, redis_db, names="a") as (a,):
        a.allowed_log_errors += ["cannot reach the cluster's Redis", "cannot read the cluster's", "Redis for this node's heartbeat",
                                 "lease to publish for the cluster ran out", "the cluster's publishing node (a) is not keeping its key"]
        made: list = []
        os.kill(redis_db.proc.pid, signal.SIGSTOP)
        try:
            t = threading.Thread(target=lambda: made.append(_outcome(lambda: a.path("d").mkdir())), daemon=True)
            t.start()
            time.sleep(1)  # the mkdir waits for Redis
            os.kill(a.pid, signal.SIGUSR1)
            wait_until(lambda: "task dump ends" in a.log_text(), 30, "the task dump")
        finally:
            os.kill(redis_db.proc.pid, signal.SIGCONT)
        t.join(60)
        assert made, "the mkdir never returned"
        rest = a.log_text().partition("task dump (SIGUSR1): ")[2]
        dump = rest.split("task dump ends")[0]
        requests = [line for line in dump.splitlines() if "tasks: request " in line]
        assert len(requests) == 1, requests
        # its lookup or the mkdir itself, each waiting on Redis in the shared namespace
        assert re.search(r"request fs/ops.py:\d+ wrapper > fs/ops.py:\d+ (lookup|mkdir) > .*cluster/namespace.py", requests[0]), requests[0]
        idle = int(re.search(r"(\d+) FUSE workers waiting for the next request", dump).group(1))
        assert idle >= 1


def _outcome(fn) -> object:
    try:
        return fn()
    except OSError as exc:
        return exc


def test_a_node_joining_after_redis_lost_the_log_is_told_at_once(tmp_path, redis_db):
    """Redis lost its data (FLUSHALL here; a restart without persistence is
    the same). The publishing node keeps renewing its key, so a node mounted
    next used to wait 120 s for it to be ready, then blame a slow restore. It
    is refused at once, with what happened and what to do."""
    store = tmp_path / "store"
    with nodes(tmp_path, redis_db, names="a") as (a,):
        a.allowed_log_errors += ["lost", "can no longer be shared"]
        a.path("f").write_bytes(b"v1")
        wait_store_matches(store, {"f": b"v1"})
        redis_db.flush()
        wait_until(lambda: "can no longer be shared" in a.log_text(), 30, "the publishing node to notice")
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="lost the cluster's log") as got, nodes(tmp_path, redis_db, names="b", store=store):
            pass
        assert time.monotonic() - t0 < 20, got.value
        assert a.path("f").read_bytes() == b"v1"


def test_a_node_that_can_apply_the_log_no_more_unmounts_at_once_listing_what_it_could_not_place(tmp_path, redis_db):
    """Redis lost the cluster's log, and a node unmounts with a file still
    open: its seal can never get a place, so the unmount does not wait for
    one through its drain timeout (600 s here); it lists the file as not
    published at once."""
    fd = None
    with nodes(tmp_path, redis_db, names="a") as (a,):
        a.allowed_log_errors += ["lost", "can no longer be shared", "cannot give a seal its place", "cannot use the cluster's log",
                                 "NOT PUBLISHED", "changes not published"]
        fd = os.open(a.path("open"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"x" * 1000)
        redis_db.flush()
        wait_until(lambda: "can no longer be shared" in a.log_text(), 30, "the node to notice")
        try:
            a.proc.send_signal(signal.SIGTERM)
            assert a.proc.wait(timeout=60) == 1
        finally:
            with contextlib.suppress(OSError):  # (the mount is gone)
                os.close(fd)
        assert ("NOT PUBLISHED: open (1000 bytes, generation 1, sealed, but the cluster's Redis never gave it a place in the log)"
                in a.log_text()), a.log_text()[-3000:]
        assert a.unexpected_log_errors() == [], a.unexpected_log_errors()


def test_a_cluster_over_s3(tmp_path, redis_db, s3):
    """Two nodes on one S3 bucket (SeaweedFS): a large and a small file of
    the node that does not publish are staged by it (hidden objects: the
    publishing node has not their bytes, and they are renamed before their
    turn) and shown by the publishing node; the marker comes after them;
    renames and rotation move and delete every node's objects; no upload is
    left open. A large file at a plain name is staged at it (an upload the
    publishing node completes), and so is one renamed right after its close
    (staged again by its node if the rename came before its turn)."""
    url = s3.bucket("cluster")
    big, bigger = os.urandom(20 << 20), os.urandom(72 << 20)  # bigger: staged while written, too
    with nodes(tmp_path, redis_db, extra=("--store", url, *s3.cli_options())) as (a, b):
        a.path("ckpt-tmp").mkdir()
        b.path("ckpt-tmp", "shard-b").write_bytes(big)
        b.path("ckpt-tmp", "optim-b").write_bytes(bigger)
        b.path("ckpt-tmp", "small-b").write_bytes(b"b" * 1000)
        a.path("ckpt-tmp", "shard-a").write_bytes(b"a" * 1000)
        os.rename(a.path("ckpt-tmp"), a.path("ckpt-1"))
        a.path("ckpt-1", "commit_success.txt").write_bytes(b"ok")
        b.path("ckpt-1", "extra-b").write_bytes(big[::-1])
        b.path("ckpt-1", "first-name").write_bytes(big[1:])
        os.rename(b.path("ckpt-1", "first-name"), b.path("ckpt-1", "renamed-b"))
        assert run_cli("flush", str(b.mountpoint), "--cluster", "--timeout", "60").returncode == 0
        objects = s3.objects("cluster")
        assert objects == {"ckpt-1/shard-a": b"a" * 1000, "ckpt-1/shard-b": big, "ckpt-1/small-b": b"b" * 1000,
                           "ckpt-1/optim-b": bigger, "ckpt-1/commit_success.txt": b"ok", "ckpt-1/extra-b": big[::-1],
                           "ckpt-1/renamed-b": big[1:]}
        assert s3.uploads("cluster") == []
        assert "ckpt-tmp/optim-b: staged while it was written" in b.log_text()
        assert a.path("ckpt-1", "shard-b").read_bytes() == big  # a loads it from the bucket, verified
        shutil.rmtree(b.path("ckpt-1"))
        assert run_cli("flush", str(a.mountpoint), "--cluster", "--timeout", "60").returncode == 0
        assert s3.objects("cluster") == {}
        assert s3.uploads("cluster") == []
        for m in (a, b):
            assert m.unexpected_log_errors() == [], m.unexpected_log_errors()


def test_a_cluster_over_s3_fails_over_and_shows_what_the_others_staged_for_the_dead_node(tmp_path, redis_db, s3):
    """Over S3: while the publishing node a is frozen, node c stages a large
    shard and b renames the checkpoint's tmp directory and writes its
    marker (a small file); then a is killed. The node that takes over hears
    of the staged files again and shows them, moves a's published shard
    with the directory, and shows the marker last; no upload stays open."""
    url = s3.bucket("failover")
    big = os.urandom(12 << 20)
    with nodes(tmp_path, redis_db, "abc", extra=("--store", url, *s3.cli_options())) as (a, b, c):
        a.path("ckpt-tmp").mkdir()
        a.path("ckpt-tmp", "shard-a").write_bytes(b"a" * 1000)
        wait_until(lambda: "ckpt-tmp/shard-a" in s3.objects("failover"), 20, "a's shard published")
        os.kill(a.pid, signal.SIGSTOP)
        c.path("ckpt-tmp", "shard-c").write_bytes(big)
        wait_until(lambda: _xattr(c.path("ckpt-tmp", "shard-c"), "state") == "staged", 20, "c's shard staged")
        os.rename(b.path("ckpt-tmp"), b.path("ckpt-1"))
        b.path("ckpt-1", "commit_success.txt").write_bytes(b"ok")
        a.proc.kill()
        a.proc.wait()
        r = run_cli("flush", str(c.mountpoint), "--cluster", "--timeout", "60")
        assert r.returncode == 0, r.stderr
        assert s3.objects("failover") == {"ckpt-1/shard-a": b"a" * 1000, "ckpt-1/shard-c": big, "ckpt-1/commit_success.txt": b"ok"}
        assert s3.uploads("failover") == []
        assert b.path("ckpt-1", "shard-c").read_bytes() == big
        for m in (b, c):
            m.allowed_log_errors += ["the cluster's publishing node a is gone", "node a died"]
            assert m.unexpected_log_errors() == [], m.unexpected_log_errors()


def test_writing_a_file_another_node_wrote_loads_it_then_takes_it_over(tmp_path, redis_db):
    """Node b opens for writing (appending) a file node a wrote: the open
    waits for a's generation to be published and loads it; b's close seals a
    new generation that supersedes a's, on every node and in the store."""
    store = tmp_path / "store"
    with nodes(tmp_path, redis_db) as (a, b):
        a.path("log.txt").write_bytes(b"from a\n")
        with open(b.path("log.txt"), "ab") as f:  # waits for a's bytes, published, then appends
            f.write(b"from b\n")
        assert b.path("log.txt").read_bytes() == b"from a\nfrom b\n"
        wait_until(lambda: a.path("log.txt").read_bytes() == b"from a\nfrom b\n", 5, "b's generation on a")
        wait_store_matches(store, {"log.txt": b"from a\nfrom b\n"})
        with open(a.path("log.txt"), "r+b") as f:  # and back: a takes it over again
            f.seek(0)
            f.write(b"FROM")
        wait_store_matches(store, {"log.txt": b"FROM a\nfrom b\n"})
        assert b.path("log.txt").read_bytes() == b"FROM a\nfrom b\n"
        for m in (a, b):
            assert m.unexpected_log_errors() == [], m.unexpected_log_errors()


def test_a_cluster_over_tls(tmp_path, redis_db):
    """rediss://: a Redis that speaks TLS only, its certificate checked
    against a CA file named in the URL; a plain redis:// URL to it is a one-line error."""
    from tests.redisserver import RedisServer

    server = RedisServer(tmp_path / "tls-redis", tls=True)
    server.start()
    try:
        with nodes(tmp_path, server) as (a, b):
            a.path("over-tls").write_bytes(b"secret")
            wait_until(lambda: b.path("over-tls").exists(), VISIBLE_S, "a's file on b")
            assert b.path("over-tls").read_bytes() == b"secret"
        mp = tmp_path / "plain"
        mp.mkdir()
        r = run_cli("mount", str(mp), "--store", str(tmp_path / "store"), "--cluster", f"redis://127.0.0.1:{server.port}/0",
                    "--cluster-password-file", str(server.password_file), timeout=60)
        assert r.returncode == 2 and "Redis at redis://127.0.0.1" in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    finally:
        server.stop()


def test_a_dead_node_s_staged_file_is_published_and_one_whose_staging_went_is_lost(tmp_path, redis_db):
    """Node b staged two files and died before the publishing node's turn
    came for them (they wait behind a's file, which cannot be staged, and a
    mkdir). The file whose staged copy is still there is published; the one
    whose staged copy went (a new daemon clears a dead one's staging) is
    reported lost, not waited for forever."""
    store = tmp_path / "store"
    with nodes(tmp_path, redis_db) as (a, b):
        b_staging = _staging_of(store, b)
        with staging_blocked(store, a):
            a.path("first").write_bytes(b"a" * 1000)  # the head of the queue, not staged
            a.path("sub").mkdir()  # a namespace change: nothing after it goes around the head
            b.path("sub", "x").write_bytes(b"x" * 1000)
            b.path("sub", "y").write_bytes(b"y" * 1000)
            wait_until(lambda: len(list(b_staging.iterdir())) == 2, 10, "b's two files staged")
            time.sleep(0.5)  # and reported
            b.proc.kill()
            b.proc.wait()
            wait_until(lambda: "node b died" in a.log_text(), 20, "a noticing b is gone")
            assert "LOST" not in a.log_text()  # both were staged
            first_staged = sorted(b_staging.iterdir(), key=lambda p: p.stat().st_mtime)[0]  # b's x
            first_staged.unlink()
        wait_until(lambda: "LOST sub/x" in a.log_text(), 30, "the file whose staged copy went, lost")
        wait_until(lambda: store_files(store).get("sub/y") == b"y" * 1000, 30, "the staged one, published")
        assert "sub/x" not in store_files(store) and store_files(store)["first"] == b"a" * 1000
        a.allowed_log_errors += ["LOST sub/x", "node b died"]
        assert a.unexpected_log_errors() == [], a.unexpected_log_errors()


def test_when_the_publishing_node_dies_another_takes_over_from_where_it_stopped(tmp_path, redis_db):
    """kill -9 of the publishing node a mid-checkpoint (its own file not
    staged: lost). One of the others takes over: the other nodes' shards,
    written into a tmp directory that a renamed (Orbax style), are published
    under the new name, the marker only after them (never while a's lost file
    is in its directory), a late node joins, and the next checkpoint works."""
    store = tmp_path / "store"
    with nodes(tmp_path, redis_db, "abc") as (a, b, c), watching(store) as seen:
        a.path("first").write_bytes(b"published before")
        wait_store_matches(store, {"first": b"published before"})
        with staging_blocked(store, a):
            a.path("tmp-1").mkdir()
            b.path("tmp-1", "shard-b").write_bytes(b"b" * 300_000)
            c.path("tmp-1", "shard-c").write_bytes(b"c" * 300_000)
            a.path("tmp-1", "shard-a").write_bytes(b"a" * 1000)  # never staged: lost with a
            a.path("tmp-1").rename(a.path("step-1"))
            b.path("step-1", "commit_success.txt").write_bytes(b"done")
            a.proc.kill()
            a.proc.wait()
        for m in (b, c):
            wait_until(lambda m=m: "LOST step-1/shard-a" in m.log_text() or "LOST tmp-1/shard-a" in m.log_text(), 20, "the lost shard")
            m.allowed_log_errors += ["LOST", "node a died", "the cluster's publishing node a is gone"]
        wait_until(lambda: sum("this node now publishes for the cluster" in m.log_text() for m in (b, c)) == 1, 30, "a node taking over")
        leader, other = (b, c) if "this node now publishes" in b.log_text() else (c, b)
        wait_until(lambda: {"step-1/shard-b", "step-1/shard-c"} <= set(store_files(store)), 30, "the shards under the new name")
        files = store_files(store)
        assert files["step-1/shard-b"] == b"b" * 300_000 and files["step-1/shard-c"] == b"c" * 300_000
        assert not any(p.startswith("tmp-1") for p in files) and "step-1/shard-a" not in files
        time.sleep(1)
        assert "step-1/commit_success.txt" not in store_files(store)  # it would vouch for a's lost shard
        rows = {n["node"]: n for n in json.loads(run_cli("status", str(other.mountpoint), "--cluster", "--json").stdout)["cluster"]["nodes"]}
        assert rows[leader.mountpoint.parent.name]["publishes"] and rows["a"]["gone"] and rows["a"]["lost_files"] == 1, rows
        late = start_mount(tmp_path / "d", store=store,
                           extra=("--cluster", redis_db.url, "--cluster-password-file", str(redis_db.password_file), "--node", "d"))
        try:
            assert late.path("step-1", "shard-b").read_bytes() == b"b" * 300_000
            late.path("step-2").mkdir()
            late.path("step-2", "shard-d").write_bytes(b"d" * 5000)
            other.path("step-2", "shard-o").write_bytes(b"o" * 5000)
            leader.path("step-2", "commit_success.txt").write_bytes(b"done 2")
            wait_until(lambda: "step-2/commit_success.txt" in store_files(store), 30, "the next checkpoint")
            assert other.path("step-2", "shard-d").read_bytes() == b"d" * 5000
            r = run_cli("flush", str(late.path("step-2")), "--timeout", "30")
            assert r.returncode == 0, r.stderr
        finally:
            stop_mount(late)
        for m in (b, c):
            assert m.unexpected_log_errors() == [], m.unexpected_log_errors()
    for snapshot in seen:  # the marker never before the data it vouches for
        if "step-2/commit_success.txt" in snapshot:
            assert {"step-2/shard-d", "step-2/shard-o"} <= snapshot


def test_a_frozen_publishing_node_is_replaced_and_follows_the_new_one_when_it_wakes(tmp_path, redis_db):
    """The publishing node a is frozen (SIGSTOP) past its key's lifetime,
    holding a file it could not stage: b takes over, reports a's file lost,
    and publishes what b writes meanwhile. When a wakes, its lease has run
    out, so it changes the store no more: it follows b, hears that its old
    file was lost, and what it writes from then on is published by b.
    Deleting the lost file lets the deletions after it through."""
    store = tmp_path / "store"
    with nodes(tmp_path, redis_db) as (a, b):
        b.path("keep").write_bytes(b"k")
        wait_store_matches(store, {"keep": b"k"})
        b.allowed_log_errors += ["the cluster's publishing node (a) is not keeping its key", "the cluster's publishing node a is gone",
                                 "node a is gone", "LOST held-by-a", "taken for gone, is back"]
        a.allowed_log_errors += ["took over publishing for the cluster while this node was frozen", "LOST held-by-a",
                                 "lease to publish for the cluster ran out", "upload", "publish of"]
        with staging_blocked(store, a):
            a.path("held-by-a").write_bytes(b"a" * 100_000)
            time.sleep(0.3)
            os.kill(a.pid, signal.SIGSTOP)
            try:
                b.path("during").write_bytes(b"written while a was frozen")
                wait_until(lambda: "this node now publishes for the cluster" in b.log_text(), 40, "b taking over")
                wait_store_matches(store, {"keep": b"k", "during": b"written while a was frozen"}, 20)
            finally:
                os.kill(a.pid, signal.SIGCONT)
        wait_until(lambda: "took over publishing for the cluster while this node was frozen" in a.log_text(), 20, "a following b")
        wait_until(lambda: "LOST held-by-a" in a.log_text(), 20, "a hearing its file was lost")
        got = subprocess.run(["getfattr", "-n", "user.ckptfs.error", "--only-values", str(a.path("held-by-a"))], capture_output=True, text=True)
        assert got.stdout.startswith("lost: node a"), got
        assert a.path("during").read_bytes() == b"written while a was frozen"
        a.path("from-a").write_bytes(b"a wrote this after waking")
        b.path("after").write_bytes(b"after a woke")
        want = {"keep": b"k", "during": b"written while a was frozen", "from-a": b"a wrote this after waking", "after": b"after a woke"}
        wait_store_matches(store, want, 30)
        assert run_cli("flush", str(a.path("from-a")), "--timeout", "30").returncode == 0
        totals = json.loads(run_cli("status", str(a.mountpoint), "--json").stdout)["totals"]
        assert totals["stalled"] == "" and totals["lost"] == 1, totals
        b.path("held-by-a").unlink()
        a.path("keep").unlink()
        del want["keep"]
        wait_store_matches(store, want, 30)
        time.sleep(1)
        assert store_files(store) == want
        for m in (a, b):
            assert m.unexpected_log_errors() == [], m.unexpected_log_errors()
        stop_mount(b)  # first: a, which follows, must not leave the index of the records it knew of when it froze
        stop_mount(a)
    assert_a_single_node_remount_shows(tmp_path, store, want)


def test_when_the_publishing_node_unmounts_first_another_takes_over(tmp_path, redis_db):
    """The publishing node unmounts cleanly while another still runs: it
    publishes what every node sealed before, leaves, and the other node
    takes over at once (no key to wait for) and publishes what it writes."""
    store = tmp_path / "store"
    with nodes(tmp_path, redis_db) as (a, b):
        b.path("before").write_bytes(b"b" * 300_000)
        stop_mount(a)
        assert a.proc.returncode == 0 and "everything published" in a.log_text(), a.log_text()[-2000:]
        assert store_files(store) == {"before": b"b" * 300_000}
        wait_until(lambda: "this node now publishes for the cluster" in b.log_text(), 10, "b taking over")
        b.path("after").write_bytes(b"after a left")
        r = run_cli("flush", str(b.mountpoint), "--timeout", "30")
        assert r.returncode == 0, r.stderr
        assert store_files(store) == {"before": b"b" * 300_000, "after": b"after a left"}
        assert b.unexpected_log_errors() == [], b.unexpected_log_errors()  # a planned hand-over: nothing to warn of
        os.unlink(b.path("before"))
        os.chmod(b.path("after"), 0o600)
        assert run_cli("flush", str(b.mountpoint), "--timeout", "30").returncode == 0
    # b, publishing since, left the index (a's, left at its exit, was exact only until b took over)
    assert_a_single_node_remount_shows(tmp_path, store, {"after": b"after a left"}, {"after": 0o600})


def test_files_still_open_at_unmount_are_published_from_any_node(tmp_path, redis_db):
    """A file still open for writing when its node unmounts is sealed as it
    is and published (README, C5), on a node that follows and on the
    publishing node: its seal gets its place in the cluster's log before
    the node stops following the log and drains."""
    store = tmp_path / "store"
    fds = []
    try:
        with nodes(tmp_path, redis_db) as (a, b):
            for m, name in ((a, "open-a"), (b, "open-b")):
                fds.append(os.open(m.path(name), os.O_WRONLY | os.O_CREAT, 0o644))
                os.write(fds[-1], name.encode() * 10_000)
            for m in (b, a):
                stop_mount(m)
                assert m.proc.returncode == 0 and "everything published" in m.log_text(), m.log_text()[-2000:]
            assert store_files(store) == {"open-a": b"open-a" * 10_000, "open-b": b"open-b" * 10_000}
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):  # (the mount is gone)
                os.close(fd)


@pytest.mark.parametrize("stop", ["the drain timeout", "a second signal"])
def test_a_file_still_open_at_unmount_whose_seal_redis_never_places_is_reported_not_published(tmp_path, redis_db, stop):
    """Redis stops answering, and a node unmounts with a file still open:
    the file is sealed, but its seal cannot get its place in the log before
    the drain's deadline, so it is never published; the exit says so (status
    1, the file listed), never "everything published". With a long drain
    timeout, a second signal stops the wait for Redis, and the exit says the
    same (it crashed instead: the queue the exit answers for was taken only
    after that wait)."""
    fd = None
    timeout = "3" if stop == "the drain timeout" else "600"
    with nodes(tmp_path, redis_db, names="a", extra=("--drain-timeout", timeout)) as (a,):
        a.allowed_log_errors += ["cannot reach the cluster's Redis", "cannot read the cluster's", "cannot give a seal its place",
                                 "Redis for this node's heartbeat", "lease to publish for the cluster ran out",
                                 "the cluster's publishing node (a) is not keeping its key", "cannot use the cluster's log at unmount",
                                 "cannot leave the cluster cleanly", "NOT PUBLISHED", "changes not published",
                                 "not waiting for write-back any longer"]
        fd = os.open(a.path("open"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"x" * 1000)
        os.kill(redis_db.proc.pid, signal.SIGSTOP)
        try:
            a.proc.send_signal(signal.SIGTERM)
            if stop == "a second signal":
                wait_until(lambda: "received SIGTERM: unmounting" in a.log_text(), 10, "a unmounting")
                time.sleep(2.5)  # (a second signal within 2 s of the first is the same request: `_Signals.SAME_REQUEST_S`)
                a.proc.send_signal(signal.SIGTERM)
            assert a.proc.wait(timeout=60) == 1
        finally:
            os.kill(redis_db.proc.pid, signal.SIGCONT)
            with contextlib.suppress(OSError):  # (the mount is gone)
                os.close(fd)
        assert ("NOT PUBLISHED: open (1000 bytes, generation 1, sealed, but the cluster's Redis never gave it a place in the log)"
                in a.log_text()), a.log_text()[-3000:]
        assert (stop == "a second signal") == ("not waiting for write-back any longer" in a.log_text())
        assert a.unexpected_log_errors() == [], a.unexpected_log_errors()


def test_a_publishing_node_that_unmounts_answers_for_what_was_sealed_before_not_after(tmp_path, redis_db):
    """The publishing node unmounts while another node's file sealed before
    cannot be staged yet, and that node writes another one during the
    drain: the exit lists the first as not published, not the second (the
    node taking over publishes it; it used to be listed too, so a busy
    cluster's publishing node never exited 0). The other node then takes
    over and publishes both."""
    store = tmp_path / "store"
    with nodes(tmp_path, redis_db, per_node={"a": ("--drain-timeout", "4")}) as (a, b):
        a.allowed_log_errors += ["NOT PUBLISHED", "changes not published"]
        with staging_blocked(store, b):
            b.path("early").write_bytes(b"e" * 1000)
            a.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: "draining write-back" in a.log_text(), 10, "a draining")
            b.path("late").write_bytes(b"l" * 1000)
            assert a.proc.wait(timeout=60) == 1
            text = a.log_text()
            assert "NOT PUBLISHED: early (1000 bytes" in text and "NOT PUBLISHED: late" not in text, text[-2000:]
            assert "with 1 changes not published" in text
        wait_until(lambda: "this node now publishes for the cluster" in b.log_text(), 20, "b taking over")
        assert run_cli("flush", str(b.mountpoint), "--timeout", "30").returncode == 0
        assert store_files(store) == {"early": b"e" * 1000, "late": b"l" * 1000}


def test_a_node_joining_a_running_cluster_loads_a_snapshot_and_does_not_wait_for_files_published_before(tmp_path, redis_db):
    """The publishing node keeps a snapshot of the namespace every few
    changes (here 5) and trims the log. A late node loads the snapshot and
    replays the rest: files published before it joined count as published
    (the publishing node's progress when it joined), so its flush, status
    and unmount do not wait for them, and it reads them from the store."""
    store = tmp_path / "store"
    every = ("--cluster-snapshot-every", "5")
    with nodes(tmp_path, redis_db, extra=every) as (a, b):
        for i in range(12):
            b.path(f"f{i}").write_bytes(b"b" * (1000 + i))
        assert run_cli("flush", str(b.mountpoint), "--cluster", "--timeout", "30").returncode == 0
        wait_until(lambda: "took a snapshot of the cluster's namespace" in a.log_text(), 10, "a snapshot")
        r = redis_db.client()
        for i in range(10):  # more changes, more snapshots: the log is trimmed to each (as far as b applied it)
            (b.mountpoint / f"d{i}").mkdir()
            time.sleep(0.3)
        wait_until(lambda: r.xlen("ckptfs:log") < int(r.get("ckptfs:head")) - 20, 10, "the log trimmed")
        shown = json.loads(run_cli("status", str(a.mountpoint), "--cluster", "--json").stdout)["cluster"]
        assert shown["snapshot_position"] > 20 and shown["behind"] == "", shown
        assert re.search(r"log position \d+, snapshot at \d+", run_cli("status", str(a.mountpoint), "--cluster").stdout)
        (b.mountpoint / "after").mkdir()  # a change after the snapshot: replayed from the log
        stop_mount(b)
        late = start_mount(tmp_path / "late", store=store,
                           extra=("--cluster", redis_db.url, "--cluster-password-file", str(redis_db.password_file), "--node", "late",
                                  *every))
        try:
            assert "loaded the cluster's namespace at log position" in late.log_text()
            assert (late.mountpoint / "after").is_dir()
            r = run_cli("flush", str(late.mountpoint), "--cluster", "--timeout", "10")
            assert r.returncode == 0, r.stderr
            totals = json.loads(run_cli("status", str(late.mountpoint), "--json").stdout)["totals"]
            assert totals["queue"] == 0 and totals["by_state"]["published"]["files"] == 12, totals
            assert late.path("f11").read_bytes() == b"b" * 1011
        finally:
            stop_mount(late)
        assert late.proc.returncode == 0 and "everything published" in late.log_text(), late.log_text()[-2000:]


def test_a_node_joining_while_another_renames_logs_no_errors(tmp_path, redis_db):
    """Another node's changes reach a joining node before its kernel has
    set up the connection (FUSE's INIT): nothing is cached there to forget
    yet. The invalidations sent then failed, each logged as an ERROR with
    a traceback (pyfuse3: "Function not implemented")."""
    store = tmp_path / "store"
    cluster = ("--cluster", redis_db.url, "--cluster-password-file", str(redis_db.password_file))
    with nodes(tmp_path, redis_db, names="a") as (a,):
        stop = threading.Event()
        a.path("d").mkdir()
        a.path("d", "x").write_bytes(b"x")

        def churn() -> None:
            while not stop.is_set():
                os.rename(a.path("d", "x"), a.path("d", "y"))
                os.rename(a.path("d", "y"), a.path("d", "x"))

        thread = threading.Thread(target=churn)
        thread.start()
        late = None
        try:
            time.sleep(0.3)
            late = start_mount(tmp_path / "late", store=store, extra=(*cluster, "--node", "late"))
            os.listdir(late.path("d"))  # the kernel caches names: later renames are forgotten there
            time.sleep(0.5)
            errors = late.unexpected_log_errors()
        finally:
            stop.set()
            thread.join()
            if late is not None:
                stop_mount(late)
        assert errors == [], errors[:5]


def test_an_empty_file_lost_with_its_node_is_rewritten_on_another(tmp_path, redis_db):
    """Rewriting a lost file (open with O_TRUNC, then write) is how a job
    resolves it. For an empty one, the write after the open tried to load
    the lost bytes first and failed with EIO: the chaos runs' writes that
    failed on a survivor right after a node was killed."""
    store = tmp_path / "store"
    with nodes(tmp_path, redis_db, "ab") as (a, b):
        with staging_blocked(store, b):
            b.path("empty-b").write_bytes(b"")
            b.proc.kill()
            b.proc.wait()
        wait_until(lambda: "LOST empty-b" in a.log_text(), 20, "the lost file reported")
        a.allowed_log_errors += ["LOST empty-b", "node b died"]
        with open(a.path("empty-b"), "wb") as f:
            f.write(b"rewritten")
        assert a.path("empty-b").read_bytes() == b"rewritten"
        wait_until(lambda: store_files(store).get("empty-b") == b"rewritten", 20, "the rewritten file in the store")


def test_after_a_node_died_with_a_lost_file_the_others_and_the_node_rejoining_read_what_changed_since(tmp_path, redis_db):
    """Node b dies with a file it never staged (lost). A removal after that
    is held back for good (until the lost file is rewritten or deleted).
    The publishing node's progress stopped there, so every other node, and
    b mounted again under its name, waited for ever on the reads of any
    file changed after it: `cat` hung, and `ls` of its directory behind it."""
    store = tmp_path / "store"
    with nodes(tmp_path, redis_db, "abc") as (a, b, c):
        a.path("old").write_bytes(b"published, then removed")
        wait_until(lambda: "old" in store_files(store), 20, "the file to remove")
        with staging_blocked(store, b):
            b.path("shard-b").write_bytes(b"b" * 100_000)
            b.proc.kill()
            b.proc.wait()
        for m in (a, c):
            wait_until(lambda m=m: "LOST shard-b" in m.log_text(), 20, f"node {m.mountpoint.parent.name} reporting the lost shard")
            m.allowed_log_errors += ["LOST shard-b", "node b died"]
        a.path("old").unlink()  # held back behind the lost file
        a.path("x").write_bytes(b"written after the removal")
        a.path("x").rename(a.path("y"))
        wait_until(lambda: "y" in store_files(store), 20, "the renamed file in the store")
        assert "old" in store_files(store)
        lazy_unmount(b.mountpoint)
        again = start_mount(tmp_path / "b-again", store=store,
                            extra=("--cluster", redis_db.url, "--cluster-password-file", str(redis_db.password_file), "--node", "b"))
        again.allowed_log_errors += ["LOST shard-b", "node b died"]
        try:
            for m in (c, again):  # neither holds y: each loads it, after the publishing node applied the rename
                got = subprocess.run(["cat", str(m.path("y"))], capture_output=True, timeout=30)
                assert got.stdout == b"written after the removal", got
            r = run_cli("flush", str(again.mountpoint), "--cluster", "--timeout", "30")
            assert r.returncode == 1 and "shard-b" in r.stderr and "old" in r.stderr, r.stdout + r.stderr  # stuck behind the lost file, said
            totals = json.loads(run_cli("status", str(c.mountpoint), "--json").stdout)["totals"]
            assert totals["queue"] == 2, totals  # the lost file and the removal behind it
        finally:
            stop_mount(again)
