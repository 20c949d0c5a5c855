"""Cluster mode's engines in-process, without FUSE: two nodes (real trees,
engines, a real Redis and a local store), so that a test decides when each
node applies the log, and so the order in which the nodes hear things."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Awaitable, Callable

import pytest
import redis
import trio
from ckptfs.cluster import events as events_module
from ckptfs.cluster import snapshot
from ckptfs.cluster.events import Events
from ckptfs.cluster.log import SharedLog, Where
from ckptfs.cluster.members import BEAT_S
from ckptfs.cluster.namespace import SharedNamespace
from ckptfs.fs.memory import MemoryPool
from ckptfs.fs.tree import RENAME_EXCHANGE, ROOT, InodeTree
from ckptfs.writeback import exchange, manifest, storeio, verify
from ckptfs.writeback.backend import open_store
from ckptfs.writeback.engine import Engine, Retry
from ckptfs.writeback.following import Following
from ckptfs.writeback.journal import FileGen
from ckptfs.writeback.state import State

W = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


class Node:
    def __init__(self, redis_db, store, name: str, publishes: bool, options: dict | None = None, late: bool = False,
                 memory: int = 1 << 28) -> None:
        self.backend = open_store(str(store), options)
        self.backend.prepare(f"{name}-{os.getpid()}-{time.time_ns():x}", time.time())
        self.tree = InodeTree(MemoryPool(memory))
        self.engine = Engine(self.backend, self.tree, retry=Retry(first_s=0.01, max_s=0.05))
        shared = SharedLog(Where(redis_db.url, str(redis_db.password_file)))
        shared.open(str(store))
        self.ns = SharedNamespace(self.tree, shared, name, self.engine)
        sealed = self.ns.load_snapshot() if late else None  # as `ClusterNode.join` does
        self.events = Events(shared, self.engine, self.ns.me, publishes)
        self.engine.cluster(self.events, self.engine.publisher if publishes else Following(self.engine, self.engine.publisher.markers))
        self.events.start()
        if sealed is not None:
            self.engine.adopt(sealed, self.ns.position)
        self.lapsed = False  # `lapse`: the heartbeat no longer renews the lease

    async def start(self, nursery: trio.Nursery, follow: bool = True, engine: bool = True, events: bool = True) -> None:
        nursery.start_soon(self._beat)
        if engine:
            await nursery.start(self.engine.run)
        if events:  # else heard from where the events stood at `Events.start` once started (`nursery.start(self.events.run)`)
            await nursery.start(self.events.run)
        await nursery.start(self.ns.place_seals)
        if follow:
            await nursery.start(self.ns.follow)

    async def _beat(self) -> None:
        """Renews the lease while this node publishes, as `ClusterNode`'s
        heartbeat does: a test that runs past one lease (a loaded machine)
        must not find the publisher waiting for it."""
        while True:
            if self.events.publishes and not self.lapsed:
                self.events.renew(time.monotonic())
            await trio.sleep(BEAT_S)

    def lapse(self) -> None:
        """The lease runs out now and is renewed no more: the publisher stops at its next store step."""
        self.lapsed = True
        self.events.lease_until = 0.0

    def keep_lease(self) -> None:
        """The heartbeat renews the lease again."""
        self.lapsed = False
        self.events.renew(time.monotonic())

    async def start_alive(self, nursery: trio.Nursery, **kw) -> trio.CancelScope:
        """`start`, within a scope of its own: cancelled, the node is gone."""
        alive = trio.CancelScope()

        async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
            with alive:
                async with trio.open_nursery() as inner:
                    await self.start(inner, **kw)
                    task_status.started()
                    await trio.sleep_forever()

        await nursery.start(run)
        return alive

    async def write(self, name: bytes, data: bytes) -> int:
        h = await self.ns.create(ROOT, name, 0o644, W, 0, 0, lambda: True)
        self.tree.write(h.fh, 0, data)
        self.tree.release(h.fh)  # seals: its place in the log comes next
        await self.ns.placed()
        return h.inode.ino

@contextlib.asynccontextmanager
async def a_dies_later(redis_db, store, options: dict | None = None):
    """Node a publishes, in a scope of its own (`a_alive`: cancelled, a is gone); node b follows."""
    a = Node(redis_db, store, "a", publishes=True, options=options)
    b = Node(redis_db, store, "b", publishes=False, options=options)
    async with trio.open_nursery() as nursery:
        a_alive = await a.start_alive(nursery)
        await b.start(nursery)
        yield nursery, a, a_alive, b


async def take_over_when_heard(a: Node, a_alive: trio.CancelScope, b: Node) -> int:
    """Once b heard how far a got, a goes and b publishes from there; returns a's position."""
    position = a.engine.publisher.position
    with trio.fail_after(10):
        while b.engine.publisher.leader_position < position:
            await trio.sleep(0.01)
    a_alive.cancel()
    await b.events.take_over(time.monotonic())
    return position


def cut_reports(a: Node) -> None:
    """From now on nothing a tells the other nodes reaches Redis."""
    def unreachable(*args):
        raise redis.ConnectionError("a's reports no longer reach Redis")

    a.events._xadd = unreachable


async def take_over_once_dead(a_alive: trio.CancelScope, b: Node) -> None:
    """Once a is gone (its store call killed it), b takes over from the last
    progress it heard, and flushes."""
    with trio.fail_after(20):
        while not a_alive.cancel_called:
            await trio.sleep(0.01)
    await b.events.take_over(time.monotonic())
    with trio.fail_after(20):
        await b.engine.flush()


async def park_a_file(b: Node, store, elsewhere) -> int:
    """b writes `top/bad/f` where a symlink planted in the store stands in
    for `top/bad`: the file is parked, and removals after it are held back
    until it goes (unlinked from `top/bad`, whose inode this returns)."""
    (store / "top").mkdir(parents=True)
    elsewhere.mkdir()
    (store / "top" / "bad").symlink_to(elsewhere)
    top = await b.ns.change("mkdir", ROOT, b"top", 0o755, 0, 0)
    bad = await b.ns.change("mkdir", top.ino, b"bad", 0o755, 0, 0)
    h = await b.ns.create(bad.ino, b"f", 0o644, W, 0, 0, lambda: True)
    b.tree.write(h.fh, 0, b"never published")
    b.tree.release(h.fh)
    await b.ns.placed()
    return bad.ino


async def rename_a_chain_held_back_before(a: Node, b: Node) -> int:
    """b renames `d` to `b`, then `e` to `d`; a applies both, beyond the
    removals it holds back, and reports so. Returns the second's seq."""
    await b.ns.change("rename", ROOT, b"d", ROOT, b"b", 0)
    await b.ns.change("rename", ROOT, b"e", ROOT, b"d", 0)
    last = b.engine.queue[-1].seq
    with trio.fail_after(20):
        while a.engine.publisher.position < last:
            await trio.sleep(0.01)
        await a.events.reported()
    return last


async def take_over_after_a_rename_chain(a_alive: trio.CancelScope, b: Node, store) -> None:
    """a applied `rename d -> b`, then `rename e -> d`; it goes, and b takes
    over and applies what is queued: the store keeps `d`'s bytes at `b`,
    and `e`'s at `d`."""
    def chain_applied() -> bool:
        return (store / "b").read_bytes() == b"d" * 1000 and (store / "d").read_bytes() == b"e" * 2000

    assert chain_applied()
    a_alive.cancel()
    await b.events.take_over(time.monotonic())
    with trio.fail_after(20):
        while b.engine.queue:
            await trio.sleep(0.01)
    assert chain_applied()


async def mkdir_in_store(b: Node, store, name: str) -> None:
    """b makes directory `name`, and the store has it."""
    await b.ns.change("mkdir", ROOT, name.encode(), 0o755, 0, 0)
    with trio.fail_after(20):
        while b.engine.queue or not (store / name).is_dir():
            await trio.sleep(0.01)


async def move_an_unshown_symlink_then_take_over(a: Node, a_alive: trio.CancelScope, b: Node, first_step: tuple[str, Callable[..., bool]],
                                                 make: Callable[[], Awaitable], move: Callable[[], Awaitable]) -> None:
    """b makes a symlink (`make`) and moves it (`move`) before a has its
    turn (a file staged late holds a back), so a applies it unshown. a
    reports that, and dies at the move's first store step (a call of the
    backend method `first_step` names, with arguments it picks); b takes
    over and flushes."""
    method, picks = first_step
    call, seq = getattr(a.backend, method), []

    def die_once_reported(*args):
        if picks(*args):
            deadline = time.monotonic() + 10
            while b.engine.publisher.leader_position < seq[0] and time.monotonic() < deadline:
                time.sleep(0.01)
            trio.from_thread.run_sync(a_alive.cancel)
            raise OSError(errno.EIO, "node a died")
        return call(*args)

    go, stage = threading.Event(), b.backend.stage

    def stage_later(*args, **kwargs):
        go.wait(20)
        return stage(*args, **kwargs)

    setattr(a.backend, method, die_once_reported)
    b.backend.stage = stage_later
    await b.write(b"slow", b"staged late")
    await make()
    seq.append(b.engine.queue[-1].seq)
    await move()
    go.set()
    await take_over_once_dead(a_alive, b)


def put_of(objpath: str) -> tuple[str, Callable[..., bool]]:
    return "put", lambda path, *args: path == objpath


def make_symlink(b: Node, at: str) -> Callable[[], Awaitable]:
    def make():
        d, _, name = at.rpartition("/")
        return b.ns.change("symlink", b.tree.inode_at(d).ino if d else ROOT, name.encode(), b"target", 0, 0)
    return make


def rename(b: Node, src: bytes, dst: bytes, flags: int = 0) -> Callable[[], Awaitable]:
    return lambda: b.ns.change("rename", ROOT, src, ROOT, dst, flags)


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


async def test_at_unmount_a_node_applies_the_log_to_its_end_then_after_its_drain_no_further(tmp_path, redis_db):
    """The publishing node unmounts while its follower lags behind the log
    and a file of its own is still open. `settle` places its seal and
    applies the log up to its end, so its drain publishes both that file
    and the one another node sealed before (the drain found nothing queued,
    and exited with the other node's file unpublished); `stop_following`,
    after the drain, takes in nothing sealed later: what it would publish
    then would race the manifest index it leaves."""
    store = tmp_path / "store"
    a = Node(redis_db, store, "a", publishes=True)
    b = Node(redis_db, store, "b", publishes=False)
    heard, wait = threading.Event(), a.ns.log.wait

    def lagging(after: int, block_s: float):
        heard.wait(30)  # a's follower hears nothing of the log until the test lets it
        return wait(after, block_s)

    a.ns.log.wait = lagging
    try:
        async with trio.open_nursery() as nursery:
            await a.start(nursery)
            await b.start(nursery)
            await b.write(b"before", b"b" * 1000)
            assert a.tree.inode_at("before") is None  # not heard yet
            await a.ns.settle()
            assert a.tree.inode_at("before") is not None
            h = await a.ns.create(ROOT, b"open", 0o644, W, 0, 0, lambda: True)
            a.tree.write(h.fh, 0, b"o" * 1000)
            append = a.ns.log.append

            def slow(*args):
                time.sleep(0.3)
                return append(*args)

            a.ns.log.append = slow
            a.tree.seal(h.inode)  # still open at the unmount: sealed as it is, its place in the log to come
            await a.ns.settle()
            assert a.engine.pending.get(h.inode.ino) is not None or a.engine.published_gen.get(h.inode.ino) == 1
            assert await a.engine.drain(20) == []
            assert (store / "before").read_bytes() == b"b" * 1000 and (store / "open").read_bytes() == b"o" * 1000
            a.ns.stop_following()
            position = a.ns.position
            await b.write(b"after", b"a" * 1000)
            heard.set()
            await trio.sleep(0.5)
            assert a.tree.inode_at("after") is None and a.ns.position == position
            nursery.cancel_scope.cancel()
    finally:
        heard.set()


async def test_a_read_after_a_directory_rename_waits_until_the_publishing_node_moved_the_file(tmp_path, redis_db):
    """Node b renames the directory holding a published file of its own,
    evicted, and reads it: the load is from the file's new path, so it
    waits until the publishing node has applied the rename (it failed at
    once, "missing from the store": only changes at or under the file's
    path were waited for, not a move of a directory above it)."""
    store = tmp_path / "store"
    a = Node(redis_db, store, "a", publishes=True)
    b = Node(redis_db, store, "b", publishes=False)
    data = os.urandom(300_000)
    async with trio.open_nursery() as nursery:
        await a.start(nursery, follow=False)  # a applies the log only when told (`catch_up`)
        await b.start(nursery)
        d = await b.ns.change("mkdir", ROOT, b"d", 0o755, 0, 0)
        h = await b.ns.create(d.ino, b"x", 0o644, W, 0, 0, lambda: True)
        b.tree.write(h.fh, 0, data)
        b.tree.release(h.fh)
        await b.ns.placed()
        ino = h.inode.ino
        await a.ns.catch_up()
        with trio.fail_after(20):
            while b.engine.published_gen.get(ino) != 1:
                await trio.sleep(0.01)
        assert b.engine.evict_file(ino)
        await b.ns.change("rename", ROOT, b"d", ROOT, b"e", 0)
        loaded = trio.Event()

        async def read() -> None:
            await b.engine.load(ino)
            loaded.set()

        nursery.start_soon(read)
        await trio.sleep(0.5)
        assert not loaded.is_set()  # a has not moved the file yet
        await a.ns.catch_up()
        with trio.fail_after(20):
            await loaded.wait()
        assert (store / "e" / "x").read_bytes() == data and b.engine.ns.resident(ino)
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


async def test_a_node_taking_over_publishing_shows_a_file_the_gone_node_held_at_its_name_then(tmp_path, redis_db):
    """Node b writes `tmp`, renames it to `mid`, then to `final`. The
    publishing node a had applied the seal and the first rename when it went
    (its turn found the file renamed away: held, at `mid`), not the second.
    b takes over from a's last progress and must hold the file where a did,
    at `mid` (its name now, followed back), so the second rename shows it
    at `final`: held at its sealed name, `tmp`, it would never be shown."""
    store = tmp_path / "store"
    a = Node(redis_db, store, "a", publishes=True)
    b = Node(redis_db, store, "b", publishes=False)
    data = b"held" * 50_000
    async with trio.open_nursery() as nursery:
        a_alive = await a.start_alive(nursery, follow=False)  # a applies the log only when told
        await b.start(nursery)
        a.lapse()  # a's lease ran out: its publisher stops at its first store step
        ino = await b.write(b"tmp", data)
        with trio.fail_after(10):
            while b.engine.pending[ino].state is not State.STAGED:  # staged (and reported) by b
                await trio.sleep(0.01)
        await b.ns.change("rename", 1, b"tmp", 1, b"mid", 0)
        await b.ns.change("rename", 1, b"mid", 1, b"final", 0)
        await a.ns.catch_up()
        with trio.fail_after(10):  # a's turn of the seal and of the first rename came; the second waits
            while not (a.engine.queue and getattr(a.engine.queue[0], "dst", "") == "final" and a.engine.publisher.current is not None):
                await trio.sleep(0.01)
        position = await take_over_when_heard(a, a_alive, b)
        # b holds the file again at the head of its queue, before a's position; the progress it
        # reports (which a node joining now counts as settled) still starts where a got.
        assert b.engine.queue[0].seq <= position and b.events._progress().position >= position
        with trio.fail_after(20):
            await b.engine.flush()
        assert (store / "final").read_bytes() == data
        assert not (store / "tmp").exists() and not (store / "mid").exists()
        assert b.engine.published_gen[ino] == 1
        nursery.cancel_scope.cancel()


async def test_a_node_taking_over_publishing_records_a_directory_the_gone_node_made_but_had_not_recorded(tmp_path, redis_db, s3):
    """On S3 an empty directory is its record alone, which the publishing
    node writes once its queue is quiet. Node a applied b's mkdir and went
    before that: the directory was in no store scan, so b, taking over, had
    it in no replica of the store and never recorded it; a flush said all
    was published, and a restart lost the directory."""
    url = s3.bucket("unrecorded")
    a = Node(redis_db, url, "a", publishes=True, options=s3.options())
    b = Node(redis_db, url, "b", publishes=False, options=s3.options())

    async def never() -> bool:  # a goes before its queue is quiet long enough to record directories
        await trio.sleep_forever()

    a.engine.publisher.sync_dirs = never
    async with trio.open_nursery() as nursery:
        a_alive = await a.start_alive(nursery)
        await b.start(nursery)
        await b.ns.change("mkdir", ROOT, b"d", 0o750, 0, 0)
        await b.ns.change("mkdir", b.tree.inode_at("d").ino, b"e", 0o700, 0, 0)
        with trio.fail_after(10):  # a applied both (the store has nothing to show for them)
            while a.engine.queue or a.engine.publisher.position == 0:
                await trio.sleep(0.01)
        await take_over_when_heard(a, a_alive, b)
        with trio.fail_after(20):
            await b.engine.flush()
        assert manifest.read(b.backend, "d").mode == 0o750
        assert manifest.read(b.backend, "d/e").mode == 0o700
        nursery.cancel_scope.cancel()


async def test_a_seal_applied_after_its_staging_and_its_publication_were_heard_is_published(tmp_path, redis_db):
    """A publishing node frozen past its lease wakes and reads what it
    missed before it applies the log: another node's file was staged
    (reported to it) and then published by the node that took over. The
    generation that the file's seal then makes is published at once; it
    used to stay staged, waited for forever (a read of it hung)."""
    store = tmp_path / "store"
    a = Node(redis_db, store, "a", publishes=True)
    b = Node(redis_db, store, "b", publishes=False)
    async with trio.open_nursery() as nursery:
        await a.start(nursery, follow=False)  # a applies the log only when told
        await b.start(nursery)
        a.lapse()  # a changes the store no more
        ino = await b.write(b"x", b"x" * 200_000)
        with trio.fail_after(10):
            while (ino, 1) not in a.engine._staged_early:  # b's report, heard before the seal
                await trio.sleep(0.01)
        digest = a.engine._staged_early[(ino, 1)][1]
        a.engine.published_elsewhere(ino, 1, "x", digest)  # what the node that took over says next
        await a.ns.catch_up()
        gen = a.engine.pending.get(ino)
        assert gen is None or gen.state is State.PUBLISHED
        assert a.engine.published_gen[ino] == 1
        nursery.cancel_scope.cancel()


async def test_a_node_that_stops_publishing_while_it_uploads_a_file_at_its_name_keeps_that_upload_for_the_next(tmp_path, redis_db, s3):
    """On S3 a large file is a multipart upload open at the file's name,
    completed at its turn, on a following node as on the publishing node.
    If another node takes over publishing while the upload is in flight,
    the upload is kept: this node reports it, and the node that publishes
    now completes it (no second upload). Here the upload is in flight for
    as long as the file is written (staged while written)."""
    url = s3.bucket("demoted")
    a = Node(redis_db, url, "a", publishes=True, options=s3.options())
    b = Node(redis_db, url, "b", publishes=False, options=s3.options())
    async with trio.open_nursery() as nursery:
        await a.start(nursery)
        await b.start(nursery)
        h = await a.ns.create(ROOT, b"big", 0o644, W, 0, 0, lambda: True)
        data = os.urandom(80 << 20)
        for off in range(0, len(data), 1 << 20):
            a.tree.write(h.fh, off, data[off : off + (1 << 20)])
            await trio.sleep(0)
        with trio.fail_after(30):  # its bytes go to an upload open at its name while it is still open
            while "big" not in await trio.to_thread.run_sync(s3.uploads, "demoted"):
                await trio.sleep(0.05)
        a.events.follow(b.ns.me, 0)  # b took over publishing while a was cut off
        await b.events.take_over(time.monotonic())
        a.tree.release(h.fh)
        await a.ns.placed()
        gen = a.engine.pending[h.inode.ino]
        attempt = gen.attempt  # its stream's
        with trio.fail_after(30):  # b took in the seal (the log reaches each node in its own time): its flush waits for it
            while h.inode.ino not in b.engine.pending and b.engine.published_gen.get(h.inode.ino, 0) < gen.generation:
                await trio.sleep(0.01)
        with trio.fail_after(60):
            await b.engine.flush()
        assert (await trio.to_thread.run_sync(s3.objects, "demoted")) == {"big": data}
        assert not await trio.to_thread.run_sync(s3.uploads, "demoted")
        with trio.fail_after(10):  # a hears it was published
            while gen.state is not State.PUBLISHED:
                await trio.sleep(0.01)
        assert gen.attempt == attempt and not gen.hidden  # the upload at its name was kept, not staged again
        nursery.cancel_scope.cancel()


async def test_a_following_node_stages_a_large_file_at_its_name_and_the_publishing_node_completes_it(tmp_path, redis_db, s3):
    """On S3 a following node's large file is a multipart upload open at
    its name, which the publishing node completes at the file's turn: its
    bytes are uploaded once, with no server-side copy from a hidden key."""
    url = s3.bucket("atname")
    a = Node(redis_db, url, "a", publishes=True, options=s3.options())
    b = Node(redis_db, url, "b", publishes=False, options=s3.options())
    data = os.urandom(20 << 20)  # above the size put whole at publication
    async with trio.open_nursery() as nursery:
        await a.start(nursery, follow=False)  # a applies the log only when told (`catch_up`)
        await b.start(nursery)
        ino = await b.write(b"shard", data)
        gen = b.engine.pending[ino]
        with trio.fail_after(30):
            while gen.state is not State.STAGED:
                await trio.sleep(0.01)
        assert gen.staged is not None and gen.staged.at == "shard" and gen.staged.token.startswith("mpu:")
        assert await trio.to_thread.run_sync(s3.uploads, "atname") == ["shard"]
        await a.ns.catch_up()
        with trio.fail_after(30):
            await a.engine.flush()
        assert (await trio.to_thread.run_sync(s3.objects, "atname")) == {"shard": data}
        assert not await trio.to_thread.run_sync(s3.uploads, "atname")
        nursery.cancel_scope.cancel()


async def test_a_staged_report_heard_after_its_file_was_overwritten_has_its_upload_aborted(tmp_path, redis_db, s3):
    """Node b stages a large file at its name (an upload left open there),
    reports it, and overwrites the file. Reports travel apart from the log,
    so the publishing node a may apply the overwrite's seal before it hears
    the first report: that generation is gone, so a aborts its upload (else
    it stayed open in the bucket for good, the second upload at the name
    completed over it)."""
    url = s3.bucket("overwritten")
    a = Node(redis_db, url, "a", publishes=True, options=s3.options())
    b = Node(redis_db, url, "b", publishes=False, options=s3.options())
    first, second = os.urandom(9 << 20), os.urandom(10 << 20)
    async with trio.open_nursery() as nursery:
        await a.start(nursery, follow=False, events=False)  # a applies the log when told, and hears reports once its events run
        await b.start(nursery)
        for data in (first, second):
            ino = await b.write(b"shard", data)
            gen = b.engine.pending[ino]
            with trio.fail_after(30):
                while gen.state is not State.STAGED:  # staged, and reported
                    await trio.sleep(0.01)
        assert len(await trio.to_thread.run_sync(s3.uploads, "overwritten")) == 2
        await a.ns.catch_up()  # both seals: the first generation is superseded before a hears of its upload
        await nursery.start(a.events.run)
        with trio.fail_after(30):
            await a.engine.flush()
        assert (await trio.to_thread.run_sync(s3.objects, "overwritten")) == {"shard": second}
        with trio.fail_after(10):  # aborted in the background (no order to keep)
            while await trio.to_thread.run_sync(s3.uploads, "overwritten"):
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()


async def test_a_large_file_renamed_before_its_turn_is_staged_again_by_its_node_and_published_at_its_new_name(tmp_path, redis_db, s3):
    """Node b's large file is staged at its name, `big`, then renamed to
    `moved` before its turn. Only b holds the bytes: the publishing node a
    aborts the upload at `big`, b stages the file again under a hidden key,
    and the rename's turn waits for it, then shows the file at `moved`.
    (Completing the upload at `big` would show the file where the mount
    no longer has it; a could not upload it again itself.)"""
    url = s3.bucket("renamed")
    a = Node(redis_db, url, "a", publishes=True, options=s3.options())
    b = Node(redis_db, url, "b", publishes=False, options=s3.options())
    data = os.urandom(20 << 20)
    async with trio.open_nursery() as nursery:
        await a.start(nursery, follow=False)  # a applies the log only when told (`catch_up`)
        await b.start(nursery)
        ino = await b.write(b"big", data)
        gen = b.engine.pending[ino]
        with trio.fail_after(30):
            while gen.state is not State.STAGED:
                await trio.sleep(0.01)
        assert gen.staged is not None and gen.staged.at == "big"
        await b.ns.change("rename", 1, b"big", 1, b"moved", 0)
        await a.ns.catch_up()
        states = set()
        with trio.fail_after(60):  # a waits for b to stage it again: uploading (by b), never failed
            while (there := a.engine.pending.get(ino)) is not None and there.state is not State.PUBLISHED:
                states.add(there.state)
                await trio.sleep(0.001)
        assert State.UPLOADING in states and State.FAILED not in states
        with trio.fail_after(60):
            await a.engine.flush()
        assert (await trio.to_thread.run_sync(s3.objects, "renamed")) == {"moved": data}
        assert not await trio.to_thread.run_sync(s3.uploads, "renamed")
        assert gen.hidden  # staged again, hidden
        with trio.fail_after(10):  # and b hears it was published
            while b.engine.pending.get(ino) is not None:
                await trio.sleep(0.01)
        assert b.engine.published_gen[ino] == 1
        nursery.cancel_scope.cancel()


async def test_a_large_file_staged_at_its_name_by_a_dead_node_and_renamed_before_its_turn_is_lost_not_shown_there(tmp_path, redis_db, s3):
    """Node b stages a large file at its name `big`, renames it to `moved`
    and dies before the file's turn. Only b could stage it again, so it is
    reported lost, never shown at `big` (C4) nor waited for in silence, and
    the upload left open at `big` is aborted."""
    url = s3.bucket("deadmove")
    a = Node(redis_db, url, "a", publishes=True, options=s3.options())
    b = Node(redis_db, url, "b", publishes=False, options=s3.options())
    async with trio.open_nursery() as nursery:
        await a.start(nursery, follow=False)  # a applies the log only when told (`catch_up`)
        b_alive = await b.start_alive(nursery)
        ino = await b.write(b"big", os.urandom(12 << 20))
        with trio.fail_after(30):
            while b.engine.pending[ino].state is not State.STAGED:
                await trio.sleep(0.01)
        await b.ns.change("rename", 1, b"big", 1, b"moved", 0)
        b_alive.cancel()  # b is gone: nothing of it aborts its upload
        await a.ns.catch_up()
        a.engine.lost(b.ns.me, "node b died")  # after its staging: what it staged is still published where it can be
        with trio.fail_after(30):
            while not (ino in a.engine.pending and a.engine.pending[ino].lost):
                await trio.sleep(0.01)
        assert a.engine.pending[ino].path == "big"  # the name it was sealed under
        with trio.fail_after(30):
            while await trio.to_thread.run_sync(s3.uploads, "deadmove"):
                await trio.sleep(0.05)
        assert await trio.to_thread.run_sync(s3.objects, "deadmove") == {}
        nursery.cancel_scope.cancel()


async def test_a_directory_of_large_files_moved_before_their_turn_is_staged_again_all_at_once(tmp_path, redis_db, s3):
    """Node b's large files in `step`, staged at their names, are moved with
    their directory to `ckpt` before their turn. The publishing node a asks
    b to stage all of them again at the move's turn, before it waits for
    the first, so the uploads run together instead of one member at a time."""
    url = s3.bucket("movedir")
    a = Node(redis_db, url, "a", publishes=True, options=s3.options())
    b = Node(redis_db, url, "b", publishes=False, options=s3.options())
    data = [os.urandom(12 << 20) for _ in range(3)]
    async with trio.open_nursery() as nursery:
        await a.start(nursery, follow=False)  # a applies the log only when told (`catch_up`)
        await b.start(nursery)
        step = await b.ns.change("mkdir", ROOT, b"step", 0o755, 0, 0)
        gens = []
        for i, d in enumerate(data):
            h = await b.ns.create(step.ino, f"f{i}".encode(), 0o644, W, 0, 0, lambda: True)
            b.tree.write(h.fh, 0, d)
            b.tree.release(h.fh)
            await b.ns.placed()
            gens.append(b.engine.pending[h.inode.ino])
        with trio.fail_after(30):
            while any(g.state is not State.STAGED for g in gens):
                await trio.sleep(0.01)
        assert [g.staged.at for g in gens] == ["step/f0", "step/f1", "step/f2"]
        await b.ns.change("rename", 1, b"step", 1, b"ckpt", 0)
        await a.ns.catch_up()
        with trio.fail_after(60):  # when the first is shown at its new name, b was asked for all three
            while not any(a.engine.published_gen.get(g.ino) for g in gens):
                await trio.sleep(0.001)
        assert all(g.hidden for g in gens)
        with trio.fail_after(60):
            await a.engine.flush()
        assert (await trio.to_thread.run_sync(s3.objects, "movedir")) == {f"ckpt/f{i}": d for i, d in enumerate(data)}
        assert not await trio.to_thread.run_sync(s3.uploads, "movedir")
        nursery.cancel_scope.cancel()


async def test_a_node_joining_after_a_snapshot_knows_what_is_published_and_what_was_lost(tmp_path, redis_db):
    """The publishing node a keeps a snapshot of the namespace and trims the
    log. Node c sealed two files and died before staging them (one before
    the snapshot, one after): a lost them. A node d joining later loads the
    snapshot and replays the rest of the log: b's files are published for d
    (nothing to wait for), and c's are lost, as on a; before, d took every
    file sealed before it joined for published."""
    store = tmp_path / "store"
    a = Node(redis_db, store, "a", publishes=True)
    b = Node(redis_db, store, "b", publishes=False)
    c = Node(redis_db, store, "c", publishes=False)

    async def lose_c(ino: int) -> None:
        with trio.fail_after(10):
            while a.engine.pending.get(ino) is None:
                await a.ns.applied.wait()
        a.engine.lost(c.ns.me, "node c is gone (no heartbeat for 5s)")
        with trio.fail_after(10):
            await a.engine.flush()

    async with trio.open_nursery() as nursery:
        await a.start(nursery)
        await b.start(nursery)
        await c.start(nursery, engine=False)  # c never stages what it seals
        before = [await b.write(f"b{i}".encode(), b"b" * (1000 + i)) for i in range(3)]
        lost_before = await c.write(b"c-before", b"c" * 100)
        await lose_c(lost_before)
        position, state = await a.ns.take_snapshot()
        a.events.save_snapshot(position, snapshot.encode(position, state), snapshot.TRIM_GRACE_S)
        with trio.fail_after(10):
            while a.ns.log.snapshot() is None:
                await trio.sleep(0.01)
        assert a.ns.log.read(0) == []  # trimmed: no node beats behind it
        after = await b.write(b"b-after", b"B" * 500)
        lost_after = await c.write(b"c-after", b"C" * 100)
        await lose_c(lost_after)
        with trio.fail_after(10):
            while b.engine.pending.get(after) is not None:
                await trio.sleep(0.01)
        await trio.sleep(0.1)  # a's progress and what it holds are in Redis

        d = Node(redis_db, store, "d", publishes=False, late=True)
        assert d.ns.position == position
        await d.start(nursery)
        assert d.ns.position == a.ns.position
        for ino in (*before, after):
            assert d.engine.pending.get(ino) is None and d.engine.published_gen[ino] == 1
        for ino, name in ((lost_before, "c-before"), (lost_after, "c-after")):
            gen = d.engine.pending[ino]
            assert gen.lost and gen.owner == c.ns.me and gen.path == name, (gen.state, gen.error)
        with trio.fail_after(10):
            await d.engine.flush()  # nothing but the lost files, which wait for nobody
        assert d.tree.inode_at("b2").size == 1002 and d.tree.inode_at("b-after").size == 500
        nursery.cancel_scope.cancel()


async def test_a_removal_held_behind_a_parked_file_holds_no_other_nodes_read_of_what_came_after(tmp_path, redis_db):
    """The publishing node holds a removal back while a file sealed before
    it is unsettled; a parked file (here: a symlink planted in the store
    where its directory goes) holds it for good. Its progress stopped just
    before that removal, so every other node, and every node joining later,
    took everything after it for not applied yet: a load of a file renamed
    since waited for ever (a node that rejoined a cluster hung in its first
    reads)."""
    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    a = Node(redis_db, store, "a", publishes=True)
    b = Node(redis_db, store, "b", publishes=False)
    async with trio.open_nursery() as nursery:
        await a.start(nursery)
        await b.start(nursery)
        await park_a_file(b, store, elsewhere)
        await b.write(b"gone", b"removed after the parked file")
        with trio.fail_after(20):
            while not (store / "gone").exists():
                await trio.sleep(0.01)
        await b.ns.change("unlink", ROOT, b"gone")
        ino = await a.write(b"w", b"written by a")
        await a.ns.change("rename", ROOT, b"w", ROOT, b"w2", 0)
        with trio.fail_after(20):  # a applied all it can: the removal waits for the parked file
            while not (a.engine.publisher.deferred and not a.engine.queue and (store / "w2").exists()):
                await trio.sleep(0.01)
        assert (store / "gone").exists()
        with trio.fail_after(10):
            await b.engine.published_for_load(ino)
        with trio.fail_after(10):  # b's status counts as unpublished only the removal held back
            while [type(op).__name__ for op in b.engine.unpublished() if not isinstance(op, FileGen)] != ["Remove"]:
                await trio.sleep(0.01)
        c = Node(redis_db, store, "c", publishes=False)  # joins now
        await c.start(nursery)
        with trio.fail_after(10):
            await c.ns.catch_up()
            await c.engine.published_for_load(ino)
        assert list(elsewhere.iterdir()) == []
        nursery.cancel_scope.cancel()


async def test_a_directory_move_the_gone_node_left_halfway_keeps_what_it_moved_already(tmp_path, redis_db):
    """Node a had moved one member of `e` to `a/x` (the rename of `e` over
    the empty `a/x`, member by member as on an object store) when it died.
    Node b, taking over, applies the rename again. Its replica of the store
    lost the member already moved: first bound to no inode (reads of it got
    EIO, 'in neither RAM nor the store'), then dropped with the old `a/x`."""
    store = tmp_path / "store"
    async with a_dies_later(redis_db, store) as (nursery, a, a_alive, b):
        top = await b.ns.change("mkdir", ROOT, b"a", 0o755, 0, 0)
        await b.ns.change("mkdir", top.ino, b"x", 0o755, 0, 0)
        e = await b.ns.change("mkdir", ROOT, b"e", 0o755, 0, 0)
        inos = {}
        for name in (b"x", b"z"):
            h = await b.ns.create(e.ino, name, 0o644, W, 0, 0, lambda: True)
            b.tree.write(h.fh, 0, name * 1000)
            b.tree.release(h.fh)
            await b.ns.placed()
            inos[name] = h.inode.ino
        with trio.fail_after(20):
            while not ((store / "e" / "x").exists() and (store / "e" / "z").exists() and (store / "a" / "x").is_dir()):
                await trio.sleep(0.01)
        a.lapse()  # a's publisher stops at its next store step: the rename's
        await b.ns.change("rename", ROOT, b"e", top.ino, b"x", 0)
        rec = manifest.read(b.backend, "e/x")  # what a did of it before it died: one member moved
        storeio.show(b.backend, rec._replace(path="a/x/x"), "e/x", "a/x/x", True)
        await take_over_when_heard(a, a_alive, b)
        with trio.fail_after(20):
            await b.engine.flush()
        assert (store / "a" / "x" / "x").read_bytes() == b"x" * 1000 and (store / "a" / "x" / "z").read_bytes() == b"z" * 1000
        assert not (store / "e").exists()
        for name, ino in inos.items():  # where a load reads them
            assert b.engine.publisher_shown(ino)[0] == f"a/x/{name.decode()}"
        nursery.cancel_scope.cancel()


async def test_a_load_that_waited_for_room_while_another_node_rewrote_the_file_loads_the_new_bytes(tmp_path, redis_db):
    """Node a loads b's file: first it waits for room in its RAM budget,
    full of its own unpublished bytes. Meanwhile b rewrites the file, and b's
    seal reaches a: the load then expected the new size from bytes the store
    still shows for the old one, and failed with EIO ('checksum mismatch',
    counted as a verify failure) instead of waiting for the new ones."""
    store = tmp_path / "store"
    a = Node(redis_db, store, "a", publishes=True, memory=4 << 20)
    b = Node(redis_db, store, "b", publishes=False)
    async with trio.open_nursery() as nursery:
        await a.start(nursery)
        await b.start(nursery, engine=False)  # b stages nothing until its engine runs
        ino = await a.write(b"f", b"1" * 3_000_000)
        with trio.fail_after(10):
            while a.engine.published_gen.get(ino) != 1:
                await trio.sleep(0.01)
        assert a.engine.residency.evict_file(ino)
        a.lapse()  # a's publisher stops: its own next file holds its RAM budget
        await a.write(b"g", b"g" * (2 << 20))
        loaded = trio.Event()
        got: list[BaseException] = []

        async def load() -> None:
            try:
                await a.engine.residency.load(ino)
            except BaseException as exc:
                got.append(exc)
            loaded.set()

        nursery.start_soon(load)
        await trio.sleep(0.3)  # waiting for room
        assert not loaded.is_set()
        await b.write(b"first", b"b's file before f, unstaged: a's publisher waits on it, not on f")
        h = await b.ns.create(ROOT, b"f", 0o644, W, 0, 0, lambda: True)  # b rewrites f
        b.tree.write(h.fh, 0, b"2" * 3_500_000)
        b.tree.release(h.fh)
        await b.ns.placed()
        with trio.fail_after(10):
            while getattr(a.engine.pending.get(ino), "generation", 0) != 2:
                await trio.sleep(0.01)
        a.keep_lease()  # g is published, then evicted: room for the load
        with trio.move_on_after(2):
            await loaded.wait()
        assert not got and not a.engine.verify_failures, got  # it waits for the new bytes
        await nursery.start(b.engine.run)
        with trio.fail_after(20):
            await loaded.wait()
        assert not got, got
        h = a.tree.open(ino, os.O_RDONLY)
        assert bytes(a.tree.read(h.fh, 0, 4_000_000)) == b"2" * 3_500_000
        a.tree.release(h.fh)
        nursery.cancel_scope.cancel()


async def test_a_load_while_this_node_takes_over_publishing_waits_for_the_new_replica(tmp_path, redis_db):
    """Node b takes over from a, which died before applying b's rename of
    a's file. A read on b during the takeover (its store scan under way)
    took b for the publishing node already, skipped the wait for that
    rename, and loaded from the new name, not in the store yet: EIO,
    'missing from the store'."""
    store = tmp_path / "store"
    async with a_dies_later(redis_db, store) as (nursery, a, a_alive, b):
        ino = await a.write(b"x", b"a's file" * 1000)
        with trio.fail_after(10):
            while not (store / "x").exists():
                await trio.sleep(0.01)
        a.lapse()  # a applies nothing more
        await b.ns.change("rename", ROOT, b"x", ROOT, b"y", 0)
        nursery.start_soon(take_over_when_heard, a, a_alive, b)
        with trio.fail_after(10):
            while not b.events.publishes:  # the takeover began; b's replica of the store is not built yet
                await trio.sleep(0)
        assert isinstance(b.engine.publisher, Following)
        with trio.fail_after(20):
            await b.engine.residency.load(ino)
        assert not b.engine.verify_failures
        assert (store / "y").read_bytes() == b"a's file" * 1000
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("kind", ["local", "s3"])
async def test_a_node_taking_over_does_not_undo_an_exchange_the_gone_node_applied_beyond_its_last_report(tmp_path, redis_db, kind, request):
    """Node a applied b's exchange of `x` and `y` to the store and died
    before it reported that progress: on a local store right after the
    rename(2) that swaps them, on S3 after the first original was deleted
    (a restart's scan finishes such an exchange from the hidden copies).
    Node b took over from the last progress it heard and applied the
    exchange again: undone in the store, each name holding the other's
    bytes, with records to match (verify found nothing). The exchange's plan,
    kept in the store while it runs, tells b how far a got."""
    if kind == "s3":
        s3 = request.getfixturevalue("s3")
        url, options = s3.bucket("exchanged"), s3.options()
    else:
        url, options = str(tmp_path / "store"), None
    a = Node(redis_db, url, "a", publishes=True, options=options)
    b = Node(redis_db, url, "b", publishes=False, options=options)
    async with trio.open_nursery() as nursery:
        a_alive = await a.start_alive(nursery)
        await b.start(nursery)
        await b.write(b"x", b"x" * 1000)
        await b.write(b"y", b"y" * 2000)
        with trio.fail_after(20):
            while a.engine.queue or not (b.backend.exists("x") and b.backend.exists("y")):
                await trio.sleep(0.01)
        step = "exchange" if kind == "local" else "delete"
        real = getattr(a.backend, step)

        def then_die(*args):
            real(*args)
            trio.from_thread.run_sync(a_alive.cancel)
            raise OSError(errno.EIO, "node a died")

        setattr(a.backend, step, then_die)
        await b.ns.change("rename", ROOT, b"x", ROOT, b"y", RENAME_EXCHANGE)
        await take_over_once_dead(a_alive, b)
        assert b"".join(b.backend.read("x")) == b"y" * 2000 and b"".join(b.backend.read("y")) == b"x" * 1000
        assert verify.verify(b.backend).clean
        nursery.cancel_scope.cancel()


async def test_a_file_the_gone_node_held_before_an_exchange_beyond_its_report_is_published_by_the_node_taking_over(tmp_path, redis_db):
    """b writes `x` and exchanges it with `y` before a's turn of `x`, so a
    holds that generation (its name shows another file), and moves it with
    the exchange; a dies in the exchange, after reporting the file's turn.
    b takes over where the exchange's plan says, beyond a's report, and
    holds the file again at the head of its queue. Its `Following`, woken
    before it was replaced, completed that generation as applied by a: it
    was never published, and every flush waited for it."""
    store = tmp_path / "store"
    async with a_dies_later(redis_db, store) as (nursery, a, a_alive, b):
        await b.write(b"y", b"y" * 2000)
        with trio.fail_after(20):
            while a.engine.queue or not (store / "y").exists():
                await trio.sleep(0.01)
        staged, go = threading.Event(), threading.Event()
        stage, move = b.backend.stage, a.backend.move

        def stage_later(*args, **kwargs):  # b stages x after the exchange: a's turn of x finds its name taken
            staged.wait(20)
            return stage(*args, **kwargs)

        def move_then_die(*args):  # the exchange's one move: y's file to x (x's file is not in the store yet)
            go.wait(20)
            move(*args)
            trio.from_thread.run_sync(a_alive.cancel)
            raise OSError(errno.EIO, "node a died")

        b.backend.stage, a.backend.move = stage_later, move_then_die
        x = await b.write(b"x", b"x" * 1000)
        await b.ns.change("rename", ROOT, b"x", ROOT, b"y", RENAME_EXCHANGE)
        staged.set()
        seq = b.engine.pending[x].seq
        with trio.fail_after(20):  # a had x's turn (held it) and b heard so; a is in the exchange
            while b.engine.publisher.leader_position < seq:
                await trio.sleep(0.01)
        go.set()
        await take_over_once_dead(a_alive, b)
        assert (store / "y").read_bytes() == b"x" * 1000 and (store / "x").read_bytes() == b"y" * 2000
        nursery.cancel_scope.cancel()


async def test_a_removal_the_gone_node_held_back_before_an_exchange_beyond_its_report_is_held_back_again(tmp_path, redis_db):
    """a holds the removal of `gone` back behind a parked file (a symlink
    planted where its directory goes), then applies b's exchange of `x` and
    `y`, its reports no longer reaching Redis, and dies in the exchange. b
    takes over where the exchange's plan says, beyond a's last report. It
    took every op up to the exchange as applied, that removal too: `gone`
    stayed in the store for good, with its record (verify: missing from the
    mount). Such a removal is now held back again, and applied once the
    parked file goes."""
    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    async with a_dies_later(redis_db, store) as (nursery, a, a_alive, b):
        bad = await park_a_file(b, store, elsewhere)
        await b.write(b"gone", b"removed after the parked file")
        await b.write(b"x", b"x" * 1000)
        await b.write(b"y", b"y" * 2000)
        with trio.fail_after(20):  # b heard a published them all (the parked file had its turn)
            while b.engine.queue or not all((store / name).exists() for name in ("gone", "x", "y")):
                await trio.sleep(0.01)
            await a.events.reported()
        cut_reports(a)
        exchange_files = a.backend.exchange

        def exchange_then_die(*args):
            exchange_files(*args)
            trio.from_thread.run_sync(a_alive.cancel)
            raise OSError(errno.EIO, "node a died")

        a.backend.exchange = exchange_then_die
        await b.ns.change("unlink", ROOT, b"gone")
        await b.ns.change("rename", ROOT, b"x", ROOT, b"y", RENAME_EXCHANGE)
        await take_over_once_dead(a_alive, b)
        assert (store / "y").read_bytes() == b"x" * 1000 and (store / "x").read_bytes() == b"y" * 2000
        assert (store / "gone").exists()  # held back still: the parked file was sealed before its removal
        await b.ns.change("unlink", bad, b"f")
        with trio.fail_after(20):
            await b.engine.flush()
        assert not (store / "gone").exists()
        assert verify.verify(b.backend).clean
        assert list(elsewhere.iterdir()) == []
        nursery.cancel_scope.cancel()


async def test_a_new_generation_the_gone_node_showed_at_one_name_of_a_hard_link_only_is_shown_at_the_other(tmp_path, redis_db):
    """b rewrites a file that has two names (a hard link). a publishes the
    new generation at its first name, reports it, and dies before the
    second (found by a takeover explorer). b heard the generation published,
    took the one name showing it for all, and never showed it at the other:
    the store kept the old bytes there for good."""
    store = tmp_path / "store"
    async with a_dies_later(redis_db, store) as (nursery, a, a_alive, b):
        q = await b.write(b"q", b"1" * 300_000)
        await b.ns.change("link", q, ROOT, b"x")
        with trio.fail_after(20):
            while a.engine.queue or not (store / "x").exists():
                await trio.sleep(0.01)
        copy = a.backend.copy

        def die(*args):  # the second name's copy, after the record: a is gone
            trio.from_thread.run_sync(a_alive.cancel)
            raise OSError(errno.EIO, "node a died")

        a.backend.copy = die
        await b.write(b"q", b"2" * 1000)  # the same inode: both names
        await take_over_once_dead(a_alive, b)
        a.backend.copy = copy
        assert (store / "q").read_bytes() == (store / "x").read_bytes() == b"2" * 1000
        assert verify.verify(b.backend).clean
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("first_name_goes", ["unlinked", "renamed over"])
async def test_a_hard_link_made_before_its_first_name_went_is_shown_by_the_node_taking_over(tmp_path, redis_db, first_name_goes):
    """b links `x` to a published file `q`, then unlinks `q` or renames
    another file over it; a dies in the link's copy (found by the takeover
    explorer). b took over: the store's `q`, taken away by a queued op, was
    bound to no inode, so the link's turn found no name showing the file,
    took its bytes for gone from the store, and showed nothing at `x`; then
    `q` went. The store lost the file."""
    store = tmp_path / "store"
    async with a_dies_later(redis_db, store) as (nursery, a, a_alive, b):
        q = await b.write(b"q", b"1" * 300_000)
        await b.write(b"y", b"2" * 1000)
        with trio.fail_after(20):
            while a.engine.queue or not (store / "q").exists() or not (store / "y").exists():
                await trio.sleep(0.01)
        copy = a.backend.copy

        def die(*args):  # the link's copy: a is gone
            trio.from_thread.run_sync(a_alive.cancel)
            raise OSError(errno.EIO, "node a died")

        a.backend.copy = die
        await b.ns.change("link", q, ROOT, b"x")
        if first_name_goes == "unlinked":
            await b.ns.change("unlink", ROOT, b"q")
        else:
            await b.ns.change("rename", ROOT, b"y", ROOT, b"q", 0)
        await take_over_once_dead(a_alive, b)
        a.backend.copy = copy
        assert (store / "x").read_bytes() == b"1" * 300_000
        assert not (store / "q").exists() if first_name_goes == "unlinked" else (store / "q").read_bytes() == b"2" * 1000
        assert verify.verify(b.backend).clean
        nursery.cancel_scope.cancel()


async def test_a_node_taking_over_does_not_apply_again_a_rename_chain_the_gone_node_applied_beyond_a_removal_it_held_back(tmp_path, redis_db):
    """a holds a removal back behind a parked file (a symlink planted where
    its directory goes), so its progress's position stays before it; it
    applies `rename d -> b` and `rename e -> d` after it, reports them applied
    beyond that position, and dies. b took over at the position and applied
    both renames again: the store's `d`, holding `e`'s bytes by then, went
    to `b`, whose bytes were lost there. b now takes over where a applied
    everything, and holds that one removal back again, until the parked
    file goes."""
    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    async with a_dies_later(redis_db, store) as (nursery, _a, a_alive, b):
        bad = await park_a_file(b, store, elsewhere)
        await b.write(b"gone", b"removed after the parked file")
        await b.write(b"d", b"d" * 1000)
        await b.write(b"e", b"e" * 2000)
        with trio.fail_after(20):
            while not all((store / name).exists() for name in ("gone", "d", "e")):
                await trio.sleep(0.01)
        await b.ns.change("unlink", ROOT, b"gone")
        await b.ns.change("rename", ROOT, b"d", ROOT, b"b", 0)
        await b.ns.change("rename", ROOT, b"e", ROOT, b"d", 0)
        last = b.engine.queue[-1].seq
        with trio.fail_after(20):  # b heard a applied both renames, beyond the removal it holds back
            while b.engine.publisher.leader_applied < last:
                await trio.sleep(0.01)
        await take_over_after_a_rename_chain(a_alive, b, store)
        assert (store / "gone").exists()  # held back still: the parked file was sealed before its removal
        await b.ns.change("unlink", bad, b"f")
        with trio.fail_after(20):
            await b.engine.flush()
        assert not (store / "gone").exists()
        assert (store / "b").read_bytes() == b"d" * 1000 and (store / "d").read_bytes() == b"e" * 2000 and not (store / "e").exists()
        assert list(elsewhere.iterdir()) == []
        nursery.cancel_scope.cancel()


async def test_a_node_taking_over_behind_more_removals_held_back_than_a_report_could_name_applies_nothing_again(tmp_path, redis_db):
    """a holds back the removal of 300 files behind a parked file (the
    rmtree of an old checkpoint), then applies `rename d -> b` and `rename
    e -> d`, reports them, and dies. Its reports named at most 256 removals
    held back, and counted nothing after the 256th as applied, so b took
    over there and applied both renames again: the store's `d`, holding
    `e`'s bytes by then, went to `b`. Reports now name removals held back
    as ranges: one range for all 300."""
    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    async with a_dies_later(redis_db, store) as (nursery, a, a_alive, b):
        bad = await park_a_file(b, store, elsewhere)
        old = await b.ns.change("mkdir", ROOT, b"old", 0o755, 0, 0)
        for i in range(300):
            h = await b.ns.create(old.ino, b"%d" % i, 0o644, W, 0, 0, lambda: True)
            b.tree.write(h.fh, 0, b"old checkpoint")
            b.tree.release(h.fh)
        await b.ns.placed()
        await b.write(b"d", b"d" * 1000)
        await b.write(b"e", b"e" * 2000)
        with trio.fail_after(30):
            while b.engine.queue or not all((store / name).exists() for name in ("old/299", "d", "e")):
                await trio.sleep(0.01)
        for i in range(300):
            await b.ns.change("unlink", old.ino, b"%d" % i)
        await rename_a_chain_held_back_before(a, b)
        await take_over_after_a_rename_chain(a_alive, b, store)
        assert len(list((store / "old").iterdir())) == 300  # held back still, behind the parked file
        await b.ns.change("unlink", bad, b"f")
        with trio.fail_after(30):
            await b.engine.flush()
        assert list((store / "old").iterdir()) == []
        assert (store / "b").read_bytes() == b"d" * 1000 and (store / "d").read_bytes() == b"e" * 2000 and not (store / "e").exists()
        assert verify.verify(b.backend).clean
        nursery.cancel_scope.cancel()


async def test_a_node_taking_over_behind_more_ranges_of_removals_held_back_than_an_event_names_applies_nothing_again(tmp_path, redis_db,
                                                                                                                 monkeypatch):
    """a holds back removals behind a parked file, in more ranges than a
    progress event names (each split by a removal a applied early: its
    name taken again), then applies `rename d -> b` and `rename e -> d`,
    reports them, and dies. Its progress counted nothing after the last
    range named as applied, and its reports, so cut, still counted as
    covering what it applied: b took over before the renames and applied
    both again, and the store's `d`, holding `e`'s bytes by then, went to
    `b`. The progress in Redis beside the events now names every range,
    and a node taking over reads it; a following node reads it too, in
    place of an event cut so (before, it waited for the renames for as
    long as the file stayed parked)."""
    monkeypatch.setattr(events_module, "WAITING_SENT", 4)  # as with 256, in fewer steps
    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    async with a_dies_later(redis_db, store) as (nursery, a, a_alive, b):
        bad = await park_a_file(b, store, elsewhere)
        names = [b"old%d" % i for i in range(8)] + [b"again%d" % i for i in range(8)] + [b"d", b"e"]
        for name in names:
            await b.write(name, name * 100 if name not in (b"d", b"e") else {b"d": b"d" * 1000, b"e": b"e" * 2000}[name])
        with trio.fail_after(30):
            while b.engine.queue or not all((store / name.decode()).exists() for name in names):
                await trio.sleep(0.01)
        for i in range(8):
            await b.ns.change("unlink", ROOT, b"old%d" % i)  # held back
            await b.ns.change("unlink", ROOT, b"again%d" % i)  # applied early, at the new file's turn: it ends a range
            await b.write(b"again%d" % i, b"new")
        last = await rename_a_chain_held_back_before(a, b)
        assert len(a.engine.publisher.removals_held(last)) == 8  # more than an event names
        with trio.fail_after(20):  # b hears it (else a read there of `b` or `d` would wait while f is parked)
            while b.engine.publisher.leader_applied < last:
                await trio.sleep(0.01)
        await take_over_after_a_rename_chain(a_alive, b, store)
        assert all((store / f"old{i}").exists() for i in range(8))  # held back still, behind the parked file
        await b.ns.change("unlink", bad, b"f")
        with trio.fail_after(30):
            await b.engine.flush()
        assert not any((store / f"old{i}").exists() for i in range(8))
        assert all((store / f"again{i}").read_bytes() == b"new" for i in range(8))
        assert (store / "b").read_bytes() == b"d" * 1000 and (store / "d").read_bytes() == b"e" * 2000 and not (store / "e").exists()
        assert verify.verify(b.backend).clean
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("kind", ["local", "s3"])
async def test_a_node_taking_over_does_not_apply_again_a_rename_chain_the_gone_node_applied_after_its_last_report(tmp_path, redis_db, kind, request):
    """b renames `d` to `b`, then `e` to `d`. a applied both to the store,
    its reports no longer reaching Redis, and died (found in a three-node
    chaos run over SeaweedFS, a killed within 10 ms). b took over from the
    last progress it heard and applied both renames again: the store's `d`,
    holding `e`'s bytes by then, went to `b`, whose bytes were lost there.
    a now changes no name an op not yet reported changed: it applies the
    second rename only once it reported the first."""
    if kind == "s3":
        s3 = request.getfixturevalue("s3")
        url, options = s3.bucket("chain"), s3.options()
    else:
        url, options = str(tmp_path / "store"), None
    async with a_dies_later(redis_db, url, options) as (nursery, a, a_alive, b):
        await b.write(b"d", b"d" * 1000)
        await b.write(b"e", b"e" * 2000)
        with trio.fail_after(20):  # b heard a published both
            while b.engine.queue:
                await trio.sleep(0.01)
            await a.events.reported()  # and a knows it reported them
        cut_reports(a)
        await b.ns.change("rename", ROOT, b"d", ROOT, b"b", 0)
        await b.ns.change("rename", ROOT, b"e", ROOT, b"d", 0)
        with trio.fail_after(20):  # a applied both renames, or waits to report the first
            while a.engine.queue and not a.events._sent.statistics().tasks_waiting:
                await trio.sleep(0.01)
        a_alive.cancel()
        await b.events.take_over(time.monotonic())
        with trio.fail_after(20):
            await b.engine.flush()
        assert b"".join(b.backend.read("b")) == b"d" * 1000 and b"".join(b.backend.read("d")) == b"e" * 2000
        assert not b.backend.exists("e")
        assert verify.verify(b.backend).clean
        nursery.cancel_scope.cancel()


async def test_a_symlink_the_gone_node_recorded_and_the_mount_removed_since_leaves_no_record(tmp_path, redis_db):
    """a recorded b's new symlink `s` and died before reporting it; `s`
    was removed since. b, taking over, applied the symlink again: the live
    mount no longer has it, so it wrote nothing, and its replica's new node
    for `s` said the store showed nothing there, in place of the record a
    wrote. The removal then deleted nothing, and the record stayed in the
    store for good (found by a takeover explorer)."""
    store = tmp_path / "store"
    async with a_dies_later(redis_db, store) as (nursery, a, a_alive, b):
        put = a.backend.put

        def then_die(objpath, *args):
            put(objpath, *args)
            if objpath == manifest.record_path("s"):  # the symlink's record (not a directory's, nor a heartbeat)
                trio.from_thread.run_sync(a_alive.cancel)
                raise OSError(errno.EIO, "node a died")

        a.backend.put = then_die
        await b.ns.change("symlink", ROOT, b"s", b"target", 0, 0)
        with trio.fail_after(20):  # removed only then: a records only a symlink its mount still has
            while not a_alive.cancel_called:
                await trio.sleep(0.01)
        await b.ns.change("unlink", ROOT, b"s")
        assert manifest.read(b.backend, "s") is not None
        await take_over_once_dead(a_alive, b)
        assert manifest.read(b.backend, "s") is None
        assert verify.verify(b.backend).clean
        nursery.cancel_scope.cancel()


async def test_a_symlink_rename_the_gone_node_applied_after_its_last_report_keeps_the_record_at_the_new_name(tmp_path, redis_db):
    """a moved symlink `s` to `t` in the store (`t`'s record written, `s`'s
    deleted) and died before reporting it. b, taking over, applied the
    rename again: it found nothing at `s`, took the rename for one of a
    file not sealed yet, and deleted the symlink's record at `t` as if a
    file were to replace it: the symlink was gone from the store for good
    (found by a takeover explorer)."""
    store = tmp_path / "store"
    async with a_dies_later(redis_db, store) as (nursery, a, a_alive, b):
        await b.ns.change("symlink", ROOT, b"s", b"target", 0, 0)
        with trio.fail_after(20):  # a recorded it and b heard so
            while b.engine.queue or manifest.read(b.backend, "s") is None:
                await trio.sleep(0.01)
            await a.events.reported()  # and a knows it reported it
        cut_reports(a)
        await b.ns.change("rename", ROOT, b"s", ROOT, b"t", 0)
        with trio.fail_after(20):  # a applied the rename (its queue may be empty before the op reaches it)
            while manifest.read(b.backend, "s") is not None or manifest.read(b.backend, "t") is None:
                await trio.sleep(0.01)
        assert manifest.read(b.backend, "t").target == "target"
        a_alive.cancel()
        await b.events.take_over(time.monotonic())
        with trio.fail_after(20):
            await b.engine.flush()
        assert manifest.read(b.backend, "s") is None and manifest.read(b.backend, "t").target == "target"
        assert verify.verify(b.backend).clean
        nursery.cancel_scope.cancel()


async def test_a_symlink_the_gone_node_applied_unshown_and_moved_over_a_file_is_shown_by_the_node_taking_over(tmp_path, redis_db):
    """b makes symlink `x` and renames it over file `a`. a had the
    symlink's turn (not shown: its name was gone by then), reported it, and
    died in the rename. b's replica, rebuilt from the store, had no `x`:
    applying the rename it took `x` for a file not sealed yet, and the store
    kept the old file at `a` for good, under the name of a symlink (found
    by a takeover explorer)."""
    store = tmp_path / "store"
    async with a_dies_later(redis_db, store) as (nursery, a, a_alive, b):
        await b.write(b"a", b"a file")
        with trio.fail_after(20):
            while b.engine.queue or not (store / "a").exists():
                await trio.sleep(0.01)
        await move_an_unshown_symlink_then_take_over(a, a_alive, b, put_of(manifest.record_path("a")), make_symlink(b, "x"),
                                                     rename(b, b"x", b"a"))
        assert not (store / "a").exists() and manifest.read(b.backend, "a").target == "target"
        assert verify.verify(b.backend).clean
        nursery.cancel_scope.cancel()


async def test_a_symlink_the_gone_node_applied_unshown_and_exchanged_with_a_directory_is_shown_by_the_node_taking_over(tmp_path, redis_db):
    """b makes symlink `x` and exchanges it with directory `y`. a had the
    symlink's turn (not shown: `x` was a directory by then), reported it,
    and died in the exchange. b's replica, rebuilt from the store, had no
    `x`: it moved the directory and never recorded the symlink at `y`
    (found by a takeover explorer)."""
    store = tmp_path / "store"
    async with a_dies_later(redis_db, store) as (nursery, a, a_alive, b):
        await mkdir_in_store(b, store, "y")
        await move_an_unshown_symlink_then_take_over(a, a_alive, b, put_of(exchange.PLAN), make_symlink(b, "x"),
                                                     rename(b, b"x", b"y", RENAME_EXCHANGE))
        assert (store / "x").is_dir() and manifest.read(b.backend, "y").target == "target"
        assert verify.verify(b.backend).clean
        nursery.cancel_scope.cancel()


async def test_a_symlink_the_gone_node_applied_unshown_and_moved_with_its_directory_is_shown_by_the_node_taking_over(tmp_path, redis_db):
    """b makes symlink `d/x` and renames `d` to `e`. a had the symlink's
    turn (not shown: `d` was gone by then), reported it, and died in the
    directory's move. b's replica, rebuilt from the store, had no `d/x`:
    the move had no symlink to record at `e/x`, and the store never showed
    it (found by the takeover explorer)."""
    store = tmp_path / "store"
    async with a_dies_later(redis_db, store) as (nursery, a, a_alive, b):
        await mkdir_in_store(b, store, "d")
        await move_an_unshown_symlink_then_take_over(a, a_alive, b, ("publish_group", lambda items, *args: bool(items)),
                                                     make_symlink(b, "d/x"), rename(b, b"d", b"e"))
        assert (store / "e").is_dir() and not (store / "d").exists() and manifest.read(b.backend, "e/x").target == "target"
        assert verify.verify(b.backend).clean
        nursery.cancel_scope.cancel()
