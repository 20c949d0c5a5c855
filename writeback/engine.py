"""The write-back engine: persists what happens on the mount to the store.

See `ENGINE.md` beside this file for the state diagram and who owns what. In
short: the store (fs/) reports seals, renames, removals and new directories
and symlinks through the `Journal` methods below, on the trio thread. Each
report becomes an `Op` in one queue, in order. Upload workers hash and stage
sealed generations in parallel, in threads, from immutable snapshots. The
publisher applies ops strictly in queue order (C3): a sealed file becomes
visible only after everything before it, under the name it has *now* (C4);
renames and removals *reconcile* what the store holds with the mount.

The engine knows nothing about FUSE; it sees the mount through `Namespace`.
"""

from __future__ import annotations

import collections
import errno
import logging
import math
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import trio

from . import manifest, storeio
from .backend import Backend, Staged
from .manifest import Digest, Record
from .state import State, transition

log = logging.getLogger(__name__)


class Snapshot(Protocol):
    size: int

    def pieces(self): ...
    def release(self) -> None: ...


class Node(Protocol):
    ino: int
    mode: int
    writers: int
    generation: int


class Namespace(Protocol):
    """The engine's view of the mount (implemented by fs.store.InodeStore)."""

    def paths_of(self, ino: int) -> list[str]: ...
    def inode_at(self, path: str) -> Node | None: ...
    def evict(self, ino: int, generation: int) -> int: ...
    def fill(self, ino: int, blocks: list[bytes]) -> None: ...
    def free_bytes(self) -> int: ...
    def resident(self, ino: int) -> bool: ...


@dataclass(frozen=True)
class Retry:
    first_s: float = 0.5
    max_s: float = 30.0
    failed_after: int = 3  # tries before a file is shown as FAILED

    def delay(self, tries: int) -> float:
        return min(self.max_s, self.first_s * 2 ** max(0, tries - 1))


@dataclass(eq=False)
class Op:
    seq: int
    done: trio.Event = field(default_factory=trio.Event, init=False)
    tries: int = field(default=0, init=False)
    error: str = field(default="", init=False)


@dataclass(eq=False)
class FileGen(Op):
    """One sealed generation of a file on its way to the store."""

    ino: int
    generation: int
    snapshot: Snapshot | None
    mode: int
    mtime_ns: int
    size: int
    path: str  # where it was when sealed (for humans; the engine re-resolves)
    state: State = State.DIRTY
    digest: Digest | None = None
    staged: Staged | None = None
    sealed_at: float = field(default_factory=time.time)
    busy: bool = False  # a worker thread is reading the snapshot
    publishing: bool = False  # the publisher has started: it can no longer be dropped

    def move(self, new: State) -> None:
        self.state = transition(self.state, new)


@dataclass(eq=False)
class NameOp(Op):
    kind: str  # "rename", "remove", "mkdir", "symlink"
    path: str
    dst: str = ""
    ino: int = 0
    is_dir: bool = False
    target: str = ""


@dataclass
class Published:
    ino: int
    generation: int
    digest: Digest | None  # None: found in the store with no record
    mode: int = 0o644
    mtime_ns: int = 0
    kind: str = "file"
    target: str = ""


@dataclass
class Counters:
    """Running totals since the daemon started (for status and metrics)."""

    uploaded_bytes: int = 0
    published_files: int = 0
    retries: int = 0
    failures: int = 0  # tries that reached `Retry.failed_after`
    evictions: int = 0
    evicted_bytes: int = 0
    loads: int = 0  # read-through: files loaded back from the store
    loaded_bytes: int = 0


THROUGHPUT_WINDOW_S = 30.0


class Engine:
    def __init__(self, backend: Backend, namespace: Namespace, *, workers: int = 4, retry: Retry = Retry(),
                 clock: Callable[[], float] = time.time) -> None:
        self.backend = backend
        self.ns = namespace
        self.retry = retry
        self.workers = workers
        self.limiter = trio.CapacityLimiter(workers)
        self.queue: collections.deque[Op] = collections.deque()
        self.published: dict[str, Published] = {}
        self.pending: dict[int, FileGen] = {}  # the newest unpublished generation per inode
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # evictable, oldest first
        self.published_gen: dict[int, int] = {}
        self.verify_failures: dict[str, str] = {}
        self._seq = 0
        self._done_seq = 0
        self._send, self._recv = trio.open_memory_channel[FileGen](math.inf)
        self._wake = trio.Event()
        self._clock = clock
        self.last_error = ""
        self.counters = Counters()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (monotonic time, bytes published)

    # -- the Journal: called by the store on the trio thread ----------------
    def sealed(self, ino: int, generation: int, snapshot: Snapshot, mode: int, mtime_ns: int) -> None:
        paths = self.ns.paths_of(ino)
        gen = FileGen(self._next(), ino, generation, snapshot, mode, mtime_ns, snapshot.size, paths[0] if paths else "")
        older = self.pending.get(ino)
        if older is not None:
            self._drop(older, "superseded by a newer generation")  # unless being published
        self.lru.pop(ino, None)
        self.pending[ino] = gen
        self.queue.append(gen)
        self._send.send_nowait(gen)
        self._notify()

    def renamed(self, src: str, dst: str, is_dir: bool) -> None:
        self._append(NameOp(self._next(), "rename", src, dst=dst, is_dir=is_dir))

    def removed(self, path: str, ino: int, is_dir: bool) -> None:
        gen = self.pending.get(ino)
        if gen is not None and not self.ns.paths_of(ino):
            self._drop(gen, "deleted before it was published")  # C4: never uploaded
        self._append(NameOp(self._next(), "remove", path, ino=ino, is_dir=is_dir))

    def made_dir(self, path: str) -> None:
        self._append(NameOp(self._next(), "mkdir", path, is_dir=True))

    def made_symlink(self, path: str, target: str) -> None:
        self._append(NameOp(self._next(), "symlink", path, target=target))

    def changed_mode(self, ino: int, mode: int) -> None:
        self._append(NameOp(self._next(), "chmod", "", ino=ino, target=oct(mode)))

    # -- waiting -------------------------------------------------------------
    async def wait_published(self, ino: int, generation: int) -> None:
        """Until `generation` of `ino` (or a newer one) is published; raises
        OSError(EIO) if it is failing or can never be published."""
        while self.published_gen.get(ino, 0) < generation:
            gen = self.pending.get(ino)
            if gen is None:
                raise OSError(errno.EIO, "the file can no longer be published (deleted?)")
            if gen.state is State.FAILED:
                raise OSError(errno.EIO, f"publishing failed: {gen.error}")
            await self._wait_change()

    async def flush(self) -> None:
        """A barrier: until everything queued before the call is applied."""
        upto = self._seq
        while self._done_seq < upto:
            await self._wait_change()

    def barrier(self, prefix: str = "") -> list[Op]:
        """What a flush of `prefix` ("" for everything) waits for: the ops
        queued now that concern it (files sealed there, renames and removals)."""
        if not prefix:
            return list(self.queue)

        def under(path: str) -> bool:
            return path == prefix or path.startswith(prefix + "/")

        out: list[Op] = []
        for op in self.queue:
            if isinstance(op, FileGen):
                if op.state is not State.DROPPED and any(under(p) for p in [op.path, *self.ns.paths_of(op.ino)]):
                    out.append(op)
            elif isinstance(op, NameOp) and (under(op.path) or (op.dst and under(op.dst))):
                out.append(op)
        return out

    async def wait_change(self) -> None:
        """Until anything in the engine changes state."""
        await self._wait_change()

    def throughput(self) -> float:
        """Bytes per second published over the last `THROUGHPUT_WINDOW_S`."""
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S

    def published_digest(self, ino: int, path: str) -> Digest | None:
        pub = self.published.get(path)
        return pub.digest if pub is not None and pub.ino == ino else None

    def unpublished(self) -> list[FileGen]:
        return [op for op in self.queue if isinstance(op, FileGen) and op.state is not State.DROPPED]

    # -- running -------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(self.workers):
                nursery.start_soon(self._upload_worker, self._recv.clone())
            nursery.start_soon(self._publisher)
            task_status.started()

    async def _upload_worker(self, recv: trio.MemoryReceiveChannel[FileGen]) -> None:
        async with recv:
            async for gen in recv:
                try:
                    await self._upload(gen)
                except Exception:  # a bug must not take the mount (and its data) down
                    log.exception("write-back upload error for %s; queued again", gen.path)
                    if gen.state not in (State.DROPPED, State.PUBLISHED):
                        gen.state, gen.staged = State.FAILED, None
                        self._send.send_nowait(gen)

    async def _upload(self, gen: FileGen) -> None:
        while gen.state in (State.DIRTY, State.FAILED) and gen.staged is None:
            paths = self.ns.paths_of(gen.ino)
            if not paths:
                self._drop(gen, "deleted before it was published")
                return
            gen.move(State.UPLOADING)
            self._notify()
            try:
                staged, digest = await self._stage(gen, paths[0])
            except Exception as exc:
                if gen.state is not State.DROPPED:
                    await self._failed(gen, "upload", exc)
                continue
            if gen.state is State.DROPPED:  # superseded or deleted meanwhile
                await trio.to_thread.run_sync(self.backend.discard, staged)
                return
            gen.staged, gen.digest = staged, digest
            gen.move(State.STAGED)
            self._notify()

    async def _stage(self, gen: FileGen, path: str) -> tuple[Staged, Digest]:
        gen.busy = True
        try:
            return await trio.to_thread.run_sync(storeio.stage, self.backend, gen.snapshot.pieces(), gen.size, path,
                                               lambda: gen.state is State.DROPPED, limiter=self.limiter)
        finally:
            gen.busy = False
            if gen.state is State.DROPPED:
                self._release(gen)
                self._notify()  # its memory is free now

    async def _failed(self, op: Op, step: str, exc: Exception) -> None:
        if isinstance(op, FileGen) and op.state in (State.DROPPED, State.PUBLISHED):
            return
        op.tries += 1
        op.error = f"{step}: {type(exc).__name__}: {exc}"
        self.last_error = op.error
        self.counters.retries += 1
        if op.tries == self.retry.failed_after:
            self.counters.failures += 1
        if isinstance(op, FileGen):
            op.move(State.FAILED)
        delay = self.retry.delay(op.tries)
        level = logging.ERROR if op.tries >= self.retry.failed_after else logging.WARNING
        log.log(level, "%s of %s failed (try %d), retrying in %.1fs: %s", step, getattr(op, "path", "?"), op.tries, delay, op.error)
        self._notify()
        await trio.sleep(delay)

    async def _publisher(self) -> None:
        while True:
            try:
                await self._publish_next()
            except Exception:  # a bug must not take the mount (and its data) down
                log.exception("write-back publisher error; retrying")
                await trio.sleep(self.retry.max_s / 10)

    async def _publish_next(self) -> None:
        while True:
            while not self.queue:
                await self._wait_change()
            op = self.queue[0]
            if isinstance(op, FileGen):
                if op.state is State.DROPPED:
                    self._complete(op)
                    continue
                if op.staged is None or op.state not in (State.STAGED, State.FAILED):
                    await self._wait_change()
                    continue
                op.publishing = True
                try:
                    await self._publish_file(op)
                except Exception as exc:
                    await self._failed(op, "publish", exc)
                    continue
                finally:
                    op.publishing = False
            else:
                try:
                    await self._apply(op)
                except Exception as exc:
                    await self._failed(op, op.kind, exc)
                    continue
            self._complete(op)

    def _complete(self, op: Op) -> None:
        popped = self.queue.popleft()
        assert popped is op
        self._done_seq = op.seq
        op.done.set()
        self._notify()

    # -- publication ---------------------------------------------------------
    async def _publish_file(self, gen: FileGen) -> None:
        paths = self.ns.paths_of(gen.ino)
        if not paths:
            gen.publishing = False
            await self._discard(gen, "deleted before it was published")
            return
        assert gen.staged is not None and gen.digest is not None
        first, others = paths[0], paths[1:]
        if not self.backend.publishable_at(gen.staged, first):
            # Staged under a name the file no longer has (C4): stage again.
            await trio.to_thread.run_sync(self.backend.discard, gen.staged)
            gen.staged = None
            gen.move(State.UPLOADING)
            gen.staged, gen.digest = await self._stage(gen, first)
            gen.move(State.STAGED)
        t0 = time.monotonic()
        for i, path in enumerate(paths):
            rec = Record(path, "file", gen.digest, self._digest_at(path), stat.S_IMODE(gen.mode), gen.mtime_ns)
            if i == 0:
                await trio.to_thread.run_sync(storeio.publish, self.backend, rec, gen.staged, path, limiter=self.limiter)
            else:
                await trio.to_thread.run_sync(storeio.copy, self.backend, rec, first, path, limiter=self.limiter)
            self.published[path] = Published(gen.ino, gen.generation, gen.digest, stat.S_IMODE(gen.mode), gen.mtime_ns)
        dt = time.monotonic() - t0
        gen.move(State.PUBLISHED)
        if self.pending.get(gen.ino) is gen:
            del self.pending[gen.ino]
        self.published_gen[gen.ino] = max(gen.generation, self.published_gen.get(gen.ino, 0))
        self._release(gen)
        self.lru[gen.ino] = None
        self.counters.uploaded_bytes += gen.size
        self.counters.published_files += 1
        self._recent.append((time.monotonic(), gen.size))
        log.info("published %s (%d bytes, generation %d, %.3fs since seal, %.1f MB/s)%s", first, gen.size, gen.generation,
                 time.time() - gen.sealed_at, gen.size / max(dt, 1e-6) / 1e6, f" and {len(others)} more links" if others else "")

    async def _discard(self, gen: FileGen, why: str) -> None:
        if gen.staged is not None:
            await trio.to_thread.run_sync(self.backend.discard, gen.staged)
            gen.staged = None
        self._drop(gen, why)

    def _drop(self, gen: FileGen, why: str) -> None:
        if gen.state in (State.DROPPED, State.PUBLISHED) or gen.publishing:
            return  # a publication under way completes; what follows it is queued after
        gen.move(State.DROPPED)
        log.debug("dropping %s generation %d: %s", gen.path, gen.generation, why)
        if self.pending.get(gen.ino) is gen:
            del self.pending[gen.ino]
        self._release(gen)
        self._notify()

    def _release(self, gen: FileGen) -> None:
        if gen.snapshot is not None and not gen.busy:
            gen.snapshot.release()
            gen.snapshot = None

    async def _apply(self, op: NameOp) -> None:
        if op.kind == "rename":
            olds = [op.path] if not op.is_dir else [p for p in list(self.published) if p == op.path or p.startswith(op.path + "/")]
            for p in olds:
                await self._reconcile(p)
            if op.is_dir:
                node = self.ns.inode_at(op.dst)
                if node is not None and stat.S_ISDIR(node.mode):
                    await trio.to_thread.run_sync(self.backend.mkdir, op.dst)
                await self._prune_dir(op.path)
        elif op.kind == "remove":
            if op.is_dir:
                await self._prune_dir(op.path)
            else:
                await self._reconcile(op.path)
        elif op.kind == "mkdir":
            node = self.ns.inode_at(op.path)
            if node is not None and stat.S_ISDIR(node.mode):  # C4: only if it still exists
                await trio.to_thread.run_sync(self.backend.mkdir, op.path)
        elif op.kind == "chmod":  # the manifest keeps modes (C8: the data is plain)
            mode = int(op.target, 8)
            for path, pub in list(self.published.items()):
                if pub.ino == op.ino and pub.kind == "file" and pub.mode != mode:
                    rec = Record(path, "file", pub.digest, None, mode, pub.mtime_ns)
                    await trio.to_thread.run_sync(manifest.write, self.backend, rec, limiter=self.limiter)
                    pub.mode = mode
        elif op.kind == "symlink":
            node = self.ns.inode_at(op.path)
            if node is not None and stat.S_ISLNK(node.mode):
                rec = Record(op.path, "symlink", target=op.target, mode=0o777)
                await trio.to_thread.run_sync(manifest.write, self.backend, rec, limiter=self.limiter)
                self.published[op.path] = Published(node.ino, 0, None, 0o777, 0, "symlink", op.target)

    async def _prune_dir(self, path: str) -> None:
        node = self.ns.inode_at(path)
        if node is None or not stat.S_ISDIR(node.mode):
            await trio.to_thread.run_sync(self.backend.rmdir, path)

    async def _reconcile(self, path: str) -> None:
        """Make what the store holds at `path` agree with the mount: keep it,
        carry it to where its file lives now, or delete it."""
        pub = self.published.get(path)
        if pub is None:
            return
        live = self.ns.inode_at(path)
        if live is not None and live.ino == pub.ino:
            return
        targets = [t for t in self.ns.paths_of(pub.ino) if t != path]
        carry = [t for t in targets
                 if not ((cur := self.published.get(t)) and cur.ino == pub.ino and cur.generation >= pub.generation)]
        if pub.kind == "symlink":
            for t in carry:
                rec = Record(t, "symlink", target=pub.target, mode=0o777)
                await trio.to_thread.run_sync(manifest.write, self.backend, rec)
                self.published[t] = Published(pub.ino, 0, None, 0o777, 0, "symlink", pub.target)
            await trio.to_thread.run_sync(manifest.delete, self.backend, path)
            del self.published[path]
            return
        for i, t in enumerate(carry):
            rec = Record(t, "file", pub.digest, self._digest_at(t), pub.mode, pub.mtime_ns)
            last = i == len(carry) - 1
            await trio.to_thread.run_sync(storeio.carry, self.backend, rec, path, t, last, limiter=self.limiter)
            self.published[t] = Published(pub.ino, pub.generation, pub.digest, pub.mode, pub.mtime_ns)
        if not carry:
            await trio.to_thread.run_sync(storeio.delete, self.backend, path, limiter=self.limiter)
        else:
            await trio.to_thread.run_sync(manifest.delete, self.backend, path)
        del self.published[path]

    def _digest_at(self, path: str) -> Digest | None:
        pub = self.published.get(path)
        return pub.digest if pub is not None else None

    # -- memory: eviction and read-through -----------------------------------
    def evict(self, nbytes: int) -> int:
        """Drop published files from RAM, least recently used first, until
        `nbytes` are freed; returns what was freed. Unpublished data stays."""
        freed = 0
        for ino in list(self.lru):
            if freed >= nbytes:
                break
            freed += self.evict_file(ino)
        return freed

    def evict_file(self, ino: int) -> int:
        """Drop one published file from RAM; 0 if it is not (all) published."""
        if ino not in self.lru:
            return 0
        got = self.ns.evict(ino, self.published_gen.get(ino, 0))
        if got or not self.ns.paths_of(ino):
            del self.lru[ino]
        if got:
            self.counters.evictions += 1
            self.counters.evicted_bytes += got
        return got

    async def make_room(self, nbytes: int, patience_s: float = math.inf) -> bool:
        """Free `nbytes` of the RAM budget: evict published files, and if that
        is not enough, wait (up to `patience_s`) for write-back to publish,
        and so free, more. False when that did not free enough."""
        with trio.move_on_after(patience_s):
            return await self._make_room(nbytes)
        return False

    async def _make_room(self, nbytes: int) -> bool:
        while self.ns.free_bytes() < nbytes:
            self.evict(nbytes - self.ns.free_bytes())
            if self.ns.free_bytes() >= nbytes:
                break
            releasing = any(isinstance(g, FileGen) and g.busy for g in self.queue)  # dropped, thread finishing
            if not self.unpublished() and not releasing:
                return False
            await self._wait_change()
        return True

    async def drain(self, timeout: float) -> list[FileGen]:
        """Publish everything queued within `timeout`; returns what is left."""
        with trio.move_on_after(timeout):
            await self.flush()
        return self.unpublished()

    def touch(self, ino: int) -> None:
        if ino in self.lru:
            self.lru.move_to_end(ino)

    async def load(self, ino: int) -> None:
        """Bring an evicted or restored file back from the store, verified."""
        found = next(((p, pub) for p, pub in self.published.items() if pub.ino == ino and pub.kind == "file"), None)
        if found is None:
            raise OSError(errno.EIO, "the file's data is in neither RAM nor the store")
        path, pub = found
        try:
            blocks, digest = await trio.to_thread.run_sync(storeio.fetch, self.backend, path, limiter=self.limiter)
        except FileNotFoundError:
            self.verify_failures[path] = "missing from the store"
            log.error("cannot load %s: missing from the store", path)
            raise OSError(errno.EIO, "missing from the store") from None
        if self.ns.free_bytes() < digest.size and not await self.make_room(digest.size):
            raise OSError(errno.ENOSPC, "no RAM to load the file into")
        if pub.digest is not None and (digest.size, digest.xxh3) != (pub.digest.size, pub.digest.xxh3):
            self.verify_failures[path] = f"checksum mismatch: store has {digest}, manifest says {pub.digest}"
            log.error("checksum mismatch reading %s from the store: %s", path, self.verify_failures[path])
            raise OSError(errno.EIO, "checksum mismatch")
        self.ns.fill(ino, blocks)
        self.lru[ino] = None
        self.counters.loads += 1
        self.counters.loaded_bytes += digest.size
        log.info("loaded %s from the store (%d bytes%s)", path, digest.size, ", verified" if pub.digest else ", no checksum recorded")

    async def prefetch(self, prefix: str = "") -> int:
        """Load every file under `prefix` whose bytes are only in the store
        (ahead of a restart's reads); returns how many were loaded."""
        n = 0
        for path, pub in list(self.published.items()):
            if pub.kind != "file" or (prefix and not (path == prefix or path.startswith(prefix.rstrip("/") + "/"))):
                continue
            node = self.ns.inode_at(path)
            if node is not None and node.ino == pub.ino and not self.ns.resident(pub.ino):
                await self.load(pub.ino)
                n += 1
        return n

    # -- restart -------------------------------------------------------------
    async def scan(self, restore: Callable[[str, int, int, int, str], Node]) -> int:
        """Show what the store holds (C9): namespace now, data on first read."""
        entries, records = await trio.to_thread.run_sync(storeio.scan, self.backend)
        n = 0
        for e in entries:
            if e.is_dir:
                restore(e.path, stat.S_IFDIR | 0o755, 0, 0, "")
                continue
            rec = records.get(e.path)
            digest = rec.matches(e.size) if rec is not None and rec.kind == "file" else None
            mode = rec.mode if rec is not None else 0o644
            node = restore(e.path, stat.S_IFREG | mode, e.size, rec.mtime_ns if rec else 0, "")
            self.published[e.path] = Published(node.ino, 1, digest, mode, rec.mtime_ns if rec else 0)
            self.published_gen[node.ino] = 1
            n += 1
        for rec in records.values():
            if rec.kind == "symlink":
                node = restore(rec.path, stat.S_IFLNK | 0o777, 0, 0, rec.target)
                self.published[rec.path] = Published(node.ino, 0, None, 0o777, 0, "symlink", rec.target)
        return n

    # -- internals -----------------------------------------------------------
    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _append(self, op: Op) -> None:
        self.queue.append(op)
        self._notify()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = trio.Event()

    async def _wait_change(self) -> None:
        await self._wake.wait()
