"""Cluster mode's engines in-process, without FUSE: two nodes (real trees,
engines, a real Redis and a local store), so that a test decides when each
node applies the log, and so the order in which the nodes hear things."""

from __future__ import annotations

import os
import time

import trio
from ckptfs.cluster.events import Events
from ckptfs.cluster.log import SharedLog, Where
from ckptfs.cluster.namespace import SharedNamespace
from ckptfs.fs.memory import MemoryPool
from ckptfs.fs.tree import ROOT, InodeTree
from ckptfs.writeback.backend import open_store
from ckptfs.writeback.engine import Engine, Retry
from ckptfs.writeback.following import Following
from ckptfs.writeback.state import State

W = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


class Node:
    def __init__(self, redis_db, store, name: str, publishes: bool) -> None:
        self.backend = open_store(str(store))
        self.backend.prepare(f"{name}-{os.getpid()}-{time.time_ns():x}", time.time())
        self.tree = InodeTree(MemoryPool(1 << 28))
        self.engine = Engine(self.backend, self.tree, retry=Retry(first_s=0.01, max_s=0.05))
        shared = SharedLog(Where(redis_db.url, str(redis_db.password_file)))
        shared.open(str(store))
        self.ns = SharedNamespace(self.tree, shared, name, self.engine)
        self.events = Events(shared, self.engine, self.ns.me, publishes)
        self.engine.cluster(self.events, self.engine.publisher if publishes else Following(self.engine, self.engine.publisher.markers))
        self.events.start()

    async def start(self, nursery: trio.Nursery, follow: bool = True) -> None:
        await nursery.start(self.engine.run)
        await nursery.start(self.events.run)
        await nursery.start(self.ns.place_seals)
        if follow:
            await nursery.start(self.ns.follow)

    async def write(self, name: bytes, data: bytes) -> int:
        h = await self.ns.create(ROOT, name, 0o644, W, 0, 0, lambda: True)
        self.tree.write(h.fh, 0, data)
        self.tree.release(h.fh)  # seals: its place in the log comes next
        await self.ns.placed()
        return h.inode.ino


async def test_a_file_staged_before_the_publishing_node_applied_its_seal_is_published(tmp_path, redis_db):
    """Node b's `staged` report reaches the publishing node a before a has
    applied b's seal from the log (a lags): a keeps the report for that
    seal instead of discarding b's staged copy, and publishes the file once
    it applies the seal."""
    store = tmp_path / "store"
    a = Node(redis_db, store, "a", publishes=True)
    b = Node(redis_db, store, "b", publishes=False)
    async with trio.open_nursery() as nursery:
        await a.start(nursery, follow=False)  # a applies the log only when told (`catch_up`)
        await b.start(nursery)
        ino = await b.write(b"shard-b", b"b" * 200_000)
        with trio.fail_after(10):
            while (ino, 1) not in a.engine._staged_early:  # b staged it and told a, which has not seen the seal
                await trio.sleep(0.01)
        assert a.tree.inode_at("shard-b") is None
        await a.ns.catch_up()
        with trio.fail_after(10):
            while not (store / "shard-b").exists():
                await trio.sleep(0.01)
        assert (store / "shard-b").read_bytes() == b"b" * 200_000
        with trio.fail_after(10):  # and b hears it was published
            while b.engine.pending.get(ino) is not None:
                await trio.sleep(0.01)
        assert b.engine.published_gen[ino] == 1
        nursery.cancel_scope.cancel()


async def test_a_publication_heard_before_its_seal_was_applied_settles_the_generation(tmp_path, redis_db):
    """A node that lags applying the log hears that the publishing node
    published a file before it applies the file's seal: the generation it
    then makes is published at once, not waited for forever."""
    store = tmp_path / "store"
    a = Node(redis_db, store, "a", publishes=True)
    b = Node(redis_db, store, "b", publishes=False)
    c = Node(redis_db, store, "c", publishes=False)
    async with trio.open_nursery() as nursery:
        await a.start(nursery)
        await b.start(nursery)
        await c.start(nursery, follow=False)  # c lags
        ino = await b.write(b"x", b"x" * 1000)
        with trio.fail_after(10):
            while c.engine.published_gen.get(ino) != 1:  # c heard the publication, not yet the seal
                await trio.sleep(0.01)
        await c.ns.catch_up()
        gen = c.engine.pending.get(ino)
        assert gen is None or gen.state is State.PUBLISHED
        with trio.fail_after(10):
            await c.engine.flush()
        nursery.cancel_scope.cancel()
