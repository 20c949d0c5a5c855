"""Cluster mode's shared namespace: replicas of one InodeTree kept in step
through one log in a real Redis (no FUSE here: the replicas are in-process,
as the daemons of several nodes would hold them)."""

from __future__ import annotations

import errno
import os
import random
import signal
import stat
import time

import pytest
import redis
import trio
from ckptfs.cluster import snapshot
from ckptfs.cluster.log import PASSWORD_ENV, ClusterError, SharedLog, Where
from ckptfs.cluster.members import LEAVE_TIMEOUT_S, Membership
from ckptfs.cluster.namespace import SharedNamespace
from ckptfs.fs.memory import MemoryPool
from ckptfs.fs.tree import ROOT, InodeTree

STORE = "file:///tmp/ckptfs-cluster-test-store"


def _where(server) -> Where:
    return Where(server.url, password_file=str(server.password_file))


def _replica(server, node: str) -> SharedNamespace:
    shared = SharedLog(_where(server))
    shared.open(STORE)
    return SharedNamespace(InodeTree(MemoryPool(64 << 20)), shared, node)


def picture(tree: InodeTree) -> dict:
    """Everything a replica must agree on, by path."""
    out = {}
    stack = [("", tree.inodes[ROOT])]
    while stack:
        path, node = stack.pop()
        out[path] = (node.ino, node.mode, node.uid, node.gid, node.nlink, node.mtime_ns, node.ctime_ns, node.target,
                     dict(node.xattrs or {}), node.size)
        for name, ino in (node.children or {}).items():
            stack.append((f"{path}/{os.fsdecode(name)}", tree.inodes[ino]))
    return out


async def _settled(*replicas: SharedNamespace) -> None:
    for r in replicas:
        await r.catch_up()


async def test_a_change_on_one_node_is_seen_on_the_others_within_a_second(redis_db):
    a, b = _replica(redis_db, "a"), _replica(redis_db, "b")
    async with trio.open_nursery() as nursery:
        await nursery.start(b.follow)
        d = await a.change("mkdir", ROOT, b"ckpt", 0o750, 1000, 1000)
        h = await a.create(d.ino, b"shard-0.pt", 0o640, os.O_WRONLY | os.O_CREAT, 1000, 1000, lambda: True)
        a.tree.release(h.fh)
        await a.change("setxattr", h.inode.ino, b"user.tag", b"\x00\xff")
        with trio.fail_after(1.0):  # the bound the README states
            while b.tree.inode_at("ckpt/shard-0.pt") is None or not b.tree.listxattr(h.inode.ino):
                await b.applied.wait()
        assert picture(b.tree) == picture(a.tree)
        assert b.tree.inode_at("ckpt").mode == stat.S_IFDIR | 0o750
        await a.change("rename", d.ino, b"shard-0.pt", ROOT, b"moved.pt", 0)
        await a.change("rmdir", ROOT, b"ckpt")
        with trio.fail_after(1.0):
            while b.tree.inode_at("ckpt") is not None:
                await b.applied.wait()
        assert picture(b.tree) == picture(a.tree)
        assert b.tree.inode_at("moved.pt").ino == h.inode.ino
        nursery.cancel_scope.cancel()


async def test_exclusive_creates_of_one_name_on_three_nodes_make_one_file(redis_db):
    replicas = [_replica(redis_db, n) for n in "abc"]
    won, lost = [], []

    async def make(r: SharedNamespace) -> None:
        try:
            h = await r.create(ROOT, b".metadata", 0o644, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0, 0, lambda: True)
            won.append((r.node, h.inode.ino))
        except OSError as exc:
            assert exc.errno == errno.EEXIST
            lost.append(r.node)

    for _ in range(5):  # several rounds: each a fresh name race
        won.clear()
        lost.clear()
        async with trio.open_nursery() as nursery:
            for r in replicas:
                nursery.start_soon(make, r)
        assert len(won) == 1 and len(lost) == 2
        await _settled(*replicas)
        assert {r.tree.inode_at(".metadata").ino for r in replicas} == {won[0][1]}
        await replicas[0].change("unlink", ROOT, b".metadata")


async def test_an_error_is_decided_at_the_change_s_place_in_the_log_alike_everywhere(redis_db):
    a, b = _replica(redis_db, "a"), _replica(redis_db, "b")
    d = await a.change("mkdir", ROOT, b"old", 0o755, 0, 0)
    await b.catch_up()
    await b.change("mknod", d.ino, b"late-shard", stat.S_IFREG | 0o644, 0, 0)  # b's file goes in first
    with pytest.raises(OSError) as got:  # a has not seen it yet: the log has, and says no
        await a.change("rmdir", ROOT, b"old")
    assert got.value.errno == errno.ENOTEMPTY
    await _settled(a, b)
    assert picture(a.tree) == picture(b.tree)
    assert a.tree.inode_at("old/late-shard") is not None


NAMES = [b"a", b"b", b"c", b"\xff\xfename", b"d"]


async def _churn(r: SharedNamespace, seed: int, n: int = 60) -> None:
    """`n` random namespace changes made on replica `r` (many refused, alike everywhere)."""
    rng = random.Random(seed)
    for _ in range(n):
        dirs = [i.ino for i in r.tree.inodes.values() if i.is_dir and i.nlink]
        parent, name = rng.choice(dirs), rng.choice(NAMES)
        op = rng.choice(["mknod", "mkdir", "symlink", "unlink", "rmdir", "rename", "setattr", "link", "setxattr"])
        try:
            if op == "mknod":
                await r.change("mknod", parent, name, stat.S_IFREG | 0o644, 0, 0)
            elif op == "mkdir":
                await r.change("mkdir", parent, name, 0o755, 0, 0)
            elif op == "symlink":
                await r.change("symlink", parent, name, b"../" + name, 0, 0)
            elif op in ("unlink", "rmdir"):
                await r.change(op, parent, name)
            elif op == "rename":
                await r.change("rename", parent, name, rng.choice(dirs), rng.choice(NAMES), rng.choice([0, 0, 1, 2]))
            elif op == "link":
                files = [i.ino for i in r.tree.inodes.values() if i.is_reg and i.nlink]
                if files:
                    await r.change("link", rng.choice(files), parent, name)
            elif op == "setxattr":
                await r.change("setxattr", parent, b"user.\xfe" + name, bytes([rng.randrange(256)]) * 3)
            else:
                await r.change("setattr", parent, mode=rng.choice([0o700, 0o755]), mtime_ns=rng.randrange(1 << 40))
        except OSError:
            pass
        if rng.random() < 0.3:
            await trio.sleep(0)


async def test_replicas_agree_after_many_concurrent_changes_and_a_late_joiner_catches_up(redis_db):
    replicas = [_replica(redis_db, n) for n in "abc"]
    rng = random.Random(7)
    async with trio.open_nursery() as nursery:
        for i, r in enumerate(replicas):
            nursery.start_soon(_churn, r, rng.randrange(1 << 30) + i)
    await _settled(*replicas)
    first = picture(replicas[0].tree)
    assert len(first) > 3
    for r in replicas[1:]:
        assert picture(r.tree) == first
    late = _replica(redis_db, "late")
    await late.catch_up()
    assert picture(late.tree) == first
    assert late.position == replicas[0].position == late.log.head()


async def _save_snapshot(r: SharedNamespace) -> int:
    """Replica `r` keeps a snapshot of its namespace and trims the log; the first position kept."""
    position, state = await r.take_snapshot()
    pipe = r.log.redis.pipeline(transaction=True)
    r.log.save_snapshot(pipe, position, snapshot.encode(position, state), snapshot.TRIM_GRACE_S)
    return pipe.execute()[0]


async def test_a_log_that_redis_lost_is_said_and_changes_fail_instead_of_spinning(redis_db):
    """Redis restarted without persistence (or flushed, or evicting keys):
    the log ends before what the nodes applied. An append went on trying
    after the end it could never reach, a node's CPU spinning and its
    caller hung for good; a node only following waited for entries that
    never come. Both now say why, and changes fail with EIO."""
    a, b = _replica(redis_db, "a"), _replica(redis_db, "b")
    async with trio.open_nursery() as nursery:
        await nursery.start(b.follow)
        await a.change("mkdir", ROOT, b"ckpt", 0o755, 0, 0)
        await _settled(a, b)
        a.log.redis.flushdb()
        with trio.fail_after(5), pytest.raises(OSError) as got:
            await a.change("mkdir", ROOT, b"after", 0o755, 0, 0)
        assert got.value.errno == errno.EIO and "Redis lost it" in str(got.value) and "mount again" in str(got.value)
        with trio.fail_after(5):
            while not b.behind:
                await trio.sleep(0.05)
        assert "Redis lost it" in b.behind
        assert b.tree.inode_at("ckpt") is not None  # what it has, it still shows
        nursery.cancel_scope.cancel()


async def test_the_log_is_trimmed_to_a_snapshot_that_late_joiners_load_but_never_past_a_beating_node(redis_db):
    a, b, c = (_replica(redis_db, n) for n in "abc")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_churn, a, 1, 150)
        nursery.start_soon(_churn, b, 2, 150)
    await _settled(a, b, c)
    a.tree.ref(await a.change("mknod", ROOT, b"kept", stat.S_IFREG | 0o644, 0, 0))
    await a.change("unlink", ROOT, b"kept")  # alive on a for the kernel's reference only: in no namespace
    await _settled(a, b, c)
    at = a.position
    assert at > 100
    # c beats, but has applied the log only up to `at - 30`: it keeps what c needs
    Membership(c.log, c.me, "c").beat(at - 30)
    assert await _save_snapshot(a) == at - 30 + 1
    assert c.log.read(0)[0][0] == at - 30 + 1
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_churn, a, 3, 40)
        nursery.start_soon(_churn, b, 4, 40)
    await _settled(a, b, c)
    Membership(c.log, c.me, "c").beat(c.position)  # c applied everything: the next snapshot trims the log to it
    at = b.position
    assert await _save_snapshot(b) == c.position + 1 == at + 1
    assert c.log.read(0) == []
    await _churn(a, 5, 30)  # changes after the snapshot
    await _settled(a, b, c)
    late = _replica(redis_db, "late")
    assert late.load_snapshot() is not None and late.position == at
    await late.catch_up()
    assert late.position == a.position
    assert picture(late.tree) == picture(a.tree) == picture(b.tree)
    assert late.tree.next_ino == a.tree.next_ino  # the next inode made is numbered alike everywhere
    await _churn(late, 6, 30)
    await _settled(a, b, late)
    assert picture(late.tree) == picture(a.tree)
    # A replica that misses entries the log no longer has cannot go on: it says so, it does not diverge
    stale = _replica(redis_db, "stale")
    await stale.catch_up()
    assert stale.position == 0 and "fell behind the cluster's log" in stale.behind
    with pytest.raises(OSError) as got:
        await stale.change("mkdir", ROOT, b"x", 0o755, 0, 0)
    assert got.value.errno == errno.EIO and "unmount it and mount it again" in str(got.value)
    # ...and, beating on, it does not hold back trimming (it needs none of the log any more)
    Membership(stale.log, stale.me, "stale").beat(stale.position, behind=True)
    await _churn(a, 7, 20)
    await _settled(a, b, c, late)
    for r in (a, b, c, late):
        Membership(r.log, r.me, r.node).beat(r.position)
    assert await _save_snapshot(a) == a.position + 1
    assert a.log.read(0) == []


async def test_redis_errors_are_one_line(redis_db, tmp_path, monkeypatch):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    closed = Where("redis://127.0.0.1:1/0")
    with pytest.raises(ClusterError, match=r"cannot reach Redis at redis://127.0.0.1:1/0"):
        SharedLog(closed).open(STORE)
    with pytest.raises(ClusterError, match="needs a password"):
        SharedLog(Where(redis_db.url)).open(STORE)
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    with pytest.raises(ClusterError, match="refused the password") as got:
        SharedLog(Where(redis_db.url, str(wrong))).open(STORE)
    assert "not-the-password" not in str(got.value)
    monkeypatch.setenv(PASSWORD_ENV, redis_db.password)
    SharedLog(Where(redis_db.url)).open(STORE)  # the password from the environment
    with pytest.raises(ClusterError, match="keeps the namespace of store file:///tmp/ckptfs-cluster-test-store, not s3://other"):
        SharedLog(Where(redis_db.url)).open("s3://other")
    with pytest.raises(ClusterError, match="not a Redis URL"):
        SharedLog(Where("http://127.0.0.1:6379"))
    with pytest.raises(ClusterError, match="cannot read the Redis password file"):
        SharedLog(Where(redis_db.url, str(tmp_path / "missing"))).open(STORE)


async def test_a_snapshot_is_the_namespace_at_one_position_while_changes_go_on(redis_db, monkeypatch):
    """A snapshot is taken a slice of inodes at a time (reads and writes go
    on meanwhile); the log waits to be applied, so it is still the namespace
    at one position: exactly what replaying the log up to there makes."""
    monkeypatch.setattr("ckptfs.cluster.namespace.SNAPSHOT_SLICE", 3)
    monkeypatch.setattr("ckptfs.cluster.namespace.SNAPSHOT_PAUSE_S", 0.01)  # time for b's changes to reach a meanwhile
    a, b = _replica(redis_db, "a"), _replica(redis_db, "b")
    await _churn(a, 11, 80)
    async with trio.open_nursery() as nursery:
        await nursery.start(a.follow)  # a applies b's changes as they come...
        nursery.start_soon(_churn, b, 12, 80)
        while b.position < 30:
            await trio.sleep(0.001)
        position, state = await a.take_snapshot()  # ...except while it takes the snapshot
        nursery.cancel_scope.cancel()
    loaded = InodeTree(MemoryPool(1 << 20))
    snapshot.load(loaded, state)
    there = _replica(redis_db, "there")
    there._apply_all([e for e in there.log.read(0) if e[0] <= position])
    assert there.position == position
    assert picture(loaded) == picture(there.tree)


def test_a_node_leaving_while_redis_stands_still_waits_briefly(redis_db):
    """A daemon's exit takes it out of the cluster: its heartbeat, and the
    publishing node's key, so that another node publishes at once. With
    Redis stopped (SIGSTOP), that waited a whole Redis call (5 s) after
    the daemon's other calls had timed out, a second signal or not."""
    shared = SharedLog(_where(redis_db))
    shared.open(STORE)
    a = Membership(shared, "id-a", "a")
    assert a.join()  # a publishes for the cluster
    os.kill(redis_db.proc.pid, signal.SIGSTOP)
    try:
        began = time.monotonic()
        with pytest.raises(redis.RedisError):
            a.leave()
        took = time.monotonic() - began
    finally:
        os.kill(redis_db.proc.pid, signal.SIGCONT)
    assert took < 3 * LEAVE_TIMEOUT_S, took
    a.leave()  # Redis answers: a leaves, key and all, and the next node to join publishes
    assert a.members() == {} and a.leader() is None
    assert Membership(shared, "id-b", "b").join()
