"""Residency: which files' bytes are in RAM, and getting them back.

Owns the least-recently-used list of files whose bytes are published (the
only ones that may be evicted, C5/C7), eviction, making room for a write, and
loads from the store (restart, evicted files): every load is checked against
the file's record, size and xxh3-128 together (C6); a mismatch, a missing
object or an unreadable record is EIO, logged, never silent.
"""

from __future__ import annotations

import collections
import errno
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio

from . import manifest, storeio
from .manifest import BLOCK, Digest, Hashing, Record
from .state import State

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)

ROOM_PATIENCE_S = 2.0  # how long a load waits for write-back to free RAM before it loads into the spill directory


class LoadTarget(Protocol):
    """Where a load puts a file's bytes (fs.memory.Loading): `place` in the
    worker thread, `show`/`release` on the owning thread."""

    size: int
    done: int
    spilled: bool
    cancelled: bool

    def place(self, piece: memoryview | bytes) -> None: ...
    def close(self) -> None: ...
    def show(self, upto: int) -> bool: ...
    def show_done(self, upto: int | None) -> bool: ...
    def release(self) -> None: ...


class _Load:
    """A load in progress: the file, where its bytes go, what they must hash to."""

    def __init__(self, ino: int, path: str, target: LoadTarget, wanted: list[Digest]) -> None:
        self.ino, self.path, self.target, self.wanted = ino, path, target, wanted
        self.error: OSError | None = None
        self.changed = trio.Event()

    def wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def show(self, upto: int) -> None:
        """Worker thread: serve the bytes up to `upto` (verified)."""
        if not trio.from_thread.run_sync(self._show, upto):
            raise storeio.Cancelled()

    def _show(self, upto: int) -> bool:
        ok = self.target.show(min(upto, self.target.size))
        self.wake()
        return ok


def _narrow(wanted: list[Digest], i: int, got: str, path: str) -> list[Digest]:
    """The digests that block `i` hashing to `got` still allows."""
    left = [d for d in wanted if d.block(i) in (None, got)]
    if wanted and not left:
        raise storeio.IntegrityError(f"checksum mismatch in block {i} ({i * BLOCK}-{(i + 1) * BLOCK} bytes) of {path}")
    return left


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


class Residency:
    def __init__(self, engine: Engine) -> None:
        self.e = engine
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # evictable, oldest first
        self.counters = Counters()
        self.verify_failures: dict[str, str] = {}
        self._expected: dict[int, Record] = {}  # restart: the record each file must match
        self._unverifiable: dict[int, str] = {}  # restart: files whose record could not be read
        self._loads: dict[int, _Load] = {}  # loads in progress
        # The expected records came from the manifest index: each is read
        # again from the store when its file first loads, and that one is
        # verified against. The index is only a cache of the records: one
        # made stale by a write straight to the store racing this mount's
        # start must cost a lookup, not a false EIO.
        self.recheck = False

    def published(self, ino: int) -> None:
        self.lru[ino] = None

    def forget(self, ino: int) -> None:
        """A new generation is sealed: the file is not evictable until published."""
        self.lru.pop(ino, None)
        self._expected.pop(ino, None)
        self._unverifiable.pop(ino, None)

    def expect(self, ino: int, record: Record) -> None:
        self._expected[ino] = record

    def unverifiable(self, ino: int, path: str) -> None:
        self._unverifiable[ino] = path

    def touch(self, ino: int) -> None:
        if ino in self.lru:
            self.lru.move_to_end(ino)

    # -- eviction --------------------------------------------------------------
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
        got = self.e.ns.evict(ino, self.e.published_gen.get(ino, 0))
        if got or not self.e.ns.paths_of(ino):
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
        ns = self.e.ns
        while ns.free_bytes() < nbytes:
            self.evict(nbytes - ns.free_bytes())
            if ns.free_bytes() >= nbytes:
                break
            releasing = any(g.readers for g in self.e.unsettled.values())  # threads still reading dropped snapshots
            if not any(g.state is not State.PARKED for g in self.e.pending.values()) and not releasing:
                return False
            await self.e.wait_change()
        return True

    # -- loads -----------------------------------------------------------------
    async def load(self, ino: int, upto: int | None = None) -> None:
        """Bring an evicted or restored file back from the store, block by
        block, each verified before it is served (C6); returns once the bytes
        up to `upto` (None: all of them) can be read. One load per file runs
        in the background; every caller waits on it."""
        load = self._loads.get(ino)
        if load is None:
            if self.e.ns.resident(ino):
                return
            load = await self._start(ino)
            if load is None:
                return
        while load.error is None and not load.target.show_done(upto):
            await load.changed.wait()
        if load.error is not None and not load.target.show_done(upto) and not self.e.ns.resident(ino):
            raise load.error  # not when a truncate meanwhile dropped the load: the file is in RAM, as it is now

    async def _start(self, ino: int) -> _Load | None:
        found = self.e.publisher_shown(ino)
        if found is None:
            raise OSError(errno.EIO, "the file's data is in neither RAM nor the store")
        path, shown = found
        if ino in self._unverifiable:
            self._fail(path, "its record in the store cannot be read")
        expected = self._expected.get(ino)
        if expected is not None and self.recheck:
            try:
                there = await self.e.calls.run(f"read the record of {path}", manifest.read, self.e.backend, path)
            except (OSError, ValueError, KeyError, TypeError) as exc:  # the index's copy, then
                log.warning("cannot read the record of %s again (%s): verifying against the manifest index", path, exc)
                there = None
            if there is not None and there.kind == "file" and ino in self._expected:
                expected = self._expected[ino] = there
        if expected is not None:
            wanted = [d for d in (expected.current, expected.previous) if d is not None]
        elif shown.digest is not None:
            wanted = [shown.digest]
        else:
            wanted = []
            log.warning("loading %s with no checksum to verify it against (not written by ckptfs)", path)
        size = shown.digest.size if shown.digest is not None else 0
        spill = self.e.ns.free_bytes() < size and not await self.make_room(size, patience_s=ROOM_PATIENCE_S)
        if ino in self._loads:  # another caller started it while this one made room
            return self._loads[ino]
        try:
            target = self.e.ns.begin_load(ino, spill)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or spill:
                raise
            target = self.e.ns.begin_load(ino, True)  # the budget went to others meanwhile
        if target is None:
            return None
        if target.spilled:
            log.info("loading %s (%d bytes) into the spill directory: the RAM budget cannot hold it", path, target.size)
        load = self._loads[ino] = _Load(ino, path, target, wanted)
        if self.e._nursery is not None:
            self.e._nursery.start_soon(self._run, load)
        else:
            await self._run(load)
        return load

    async def _run(self, load: _Load) -> None:
        try:
            await self.e.calls.run(f"load {load.path}", self._stream, load, nbytes=load.target.size)
            if not load.target.show(load.target.size):
                raise storeio.Cancelled()
        except BaseException as exc:
            load.target.release()
            if isinstance(exc, storeio.Cancelled):  # truncated, replaced or deleted meanwhile: nothing to load
                log.info("stopped loading %s: the file changed meanwhile", load.path)
                load.error = OSError(errno.EIO, "the file changed while it was loading")
            elif isinstance(exc, FileNotFoundError):
                load.error = self._failed(load.path, "missing from the store")
            elif isinstance(exc, storeio.IntegrityError):
                load.error = self._failed(load.path, str(exc))
            else:
                log.error("cannot load %s from the store: %s", load.path, exc)
                load.error = exc if isinstance(exc, OSError) else OSError(errno.EIO, str(exc))
            if not isinstance(exc, Exception):
                raise
        else:
            self.lru[load.ino] = None
            self.counters.loads += 1
            self.counters.loaded_bytes += load.target.size
            log.info("loaded %s from the store (%d bytes%s%s)", load.path, load.target.size,
                     ", verified" if load.wanted else "", ", into the spill directory" if load.target.spilled else "")
        finally:
            del self._loads[load.ino]
            load.wake()

    def _stream(self, load: _Load) -> None:
        """Worker thread: read the file from the store, place its bytes, and
        serve each block once its hash matches the record's."""
        target = load.target
        hashing = Hashing()
        wanted = list(load.wanted)
        try:
            for piece in self.e.backend.read(load.path):
                if target.cancelled:
                    raise storeio.Cancelled()
                target.place(piece)
                before = len(hashing.blocks)
                hashing.update(piece)
                for i in range(before, len(hashing.blocks)):
                    wanted = _narrow(wanted, i, hashing.blocks[i], load.path)
                    # the last block is served only once the whole file is checked (in _run)
                    if (i + 1) * BLOCK < target.size and all(d.block(i) is not None for d in wanted):
                        load.show((i + 1) * BLOCK)  # else: verified only as a whole, at the end
            got = hashing.digest()
            if wanted and not any(d == got for d in wanted):
                want = " or ".join(str(d) for d in load.wanted)
                raise storeio.IntegrityError(f"checksum mismatch: the store has {got.size} bytes with xxh3 {got.xxh3}, "
                                             f"the manifest says {want}")
            if got.size != target.size:
                raise storeio.IntegrityError(f"the store has {got.size} bytes, the file {target.size}")
        finally:
            target.close()

    def _failed(self, path: str, why: str) -> OSError:
        self.verify_failures[path] = why
        log.error("cannot load %s from the store: %s", path, why)
        return OSError(errno.EIO, why)

    def _fail(self, path: str, why: str) -> None:
        raise self._failed(path, why)

    async def prefetch(self, prefix: str = "") -> int:
        """Load every file under `prefix` whose bytes are only in the store
        (ahead of a restart's reads); returns how many were loaded."""
        from .replica import File

        n = 0
        base = prefix.rstrip("/")
        start = self.e.publisher.replica.lookup(base) if base else self.e.publisher.replica.root
        if start is None:
            return 0
        items = [(base, start)] if isinstance(start, File) else [(f"{base}/{rel}" if base else rel, node)
                                                                  for rel, node in self.e.publisher.replica.walk(start)]
        for path, node in items:
            if not isinstance(node, File) or node.shown is None:
                continue
            live = self.e.ns.inode_at(path)
            if live is not None and live.ino == node.ino and not self.e.ns.resident(node.ino):
                await self.load(node.ino)
                n += 1
        return n
