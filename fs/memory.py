"""RAM accounting and file contents.

`MemoryPool` owns the RAM budget and a small stock of recycled chunks;
`FileData` holds one file's bytes as sparse fixed-size chunks. Nothing here
knows about FUSE, inodes or paths.

Why chunks: a save must never copy what it already wrote (no realloc of a
growing buffer), holes must cost nothing (`truncate -s 1P` allocates no
memory), and freed memory must go back to the OS so the daemon's RSS tracks
the data it holds. Large chunks are anonymous mmaps (returned to the OS on
close, prefaulted in a few system calls instead of a page fault per 4 KiB,
with the GIL let go meanwhile, ahead of the writes that take them); small
files live in bytearrays sized to their content.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator

from ckptfs.holes import ZEROS, is_hole, read_sparse, zeros

log = logging.getLogger(__name__)

HELD_BYTES = 192 << 20  # a file read in place holds at most this much of its verified blocks in RAM, for its reader (`Borrowing`)
HELD_IDLE_S = 0.2  # a held block that no read came for this long is let go
HELD_MAX_S = 1.0  # a load waits for its reader this long at most per block (a slower reader's blocks go through the page cache)
CHUNK = 4 << 20  # big enough to keep mmap counts low (vm.max_map_count)
SCRATCH = 128 << 10  # a block verified through the scratch is read this much at a time (`Borrowing.view`)
MADE_AHEAD = 8  # fresh chunks the pool keeps made ahead while writes take them (`MemoryPool._tend`)
TEND_IDLE_S = 1.0  # the pool's thread ends after this long with nothing to do
SMALL_MAX = 256 << 10  # below this a chunk is a bytearray sized to its content
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+ (not in the mmap module of Python 3.11)
_libc = ctypes.CDLL(None, use_errno=True)  # (a CDLL's calls let go of the GIL)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_populate_write = True  # madvise(MADV_POPULATE_WRITE) works here (`new_chunk`)
_POPULATE_STEP = 1 << 20  # faulted in this much per system call (`new_chunk`)
assert len(ZEROS) == CHUNK  # a hole piece covers at most one chunk


class MemoryPool:
    """The RAM budget shared by every file, plus a stock of chunks ready to
    write into.

    `used` counts exactly the bytes held by file contents (chunk capacities).
    The stock (`kept`) holds chunks already faulted in: those freed by
    deletes, truncates and evictions, and fresh ones made ahead while writes
    take them. Together they stay within `reuse` bytes and within what the
    budget leaves free beside the file data. Writing into memory already
    faulted in is several times faster than into fresh memory on VMs that
    hand freed pages back to the host. (MADV_FREE on kept chunks was
    measured: rewriting lazily-freed pages costs twice as much.) Every other
    freed chunk goes back to the OS, so the daemon's RSS follows the data it
    holds.

    The system calls behind both run in a thread of the pool's own (`_tend`),
    the GIL let go, not on the event loop, which answers every request to
    the mount (it makes a chunk itself only when the thread has none ready
    for it): faulting in a fresh chunk costs 1.1-1.5 ms on a VM (0.58 s of a
    2 GiB save, which took 1.12 s made ahead where it took 1.50), unmapping
    one 0.25 ms (a stall of 70 ms per GiB deleted or evicted past the stock).
    A chunk let go but not unmapped yet (`_dying`) is as good as a kept one:
    writes take it before any fresh memory, so the RSS never grows while it
    waits. The thread runs while there is work, and ends after
    `TEND_IDLE_S` without.

    Everything but that thread runs on one thread (the event loop), but for
    `take_made`, which loads' workers call; `_lock` makes the thread's steps,
    those takes and the accounting of the budget one against the other.
    """

    def __init__(self, limit: int, reuse: int | None = None, made_ahead: int = MADE_AHEAD) -> None:
        self.limit = limit
        self.reuse = limit if reuse is None else min(reuse, limit)
        self.made_ahead = made_ahead  # fresh chunks to have ready (0: each is made when a write takes it)
        self.used = 0
        self._freed: list[mmap.mmap] = []  # recycled, taken last in first out
        self._made: collections.deque[mmap.mmap] = collections.deque()  # made ahead
        self._dying: collections.deque[mmap.mmap] = collections.deque()  # let go past the stock's bounds, to unmap
        self._unmapping = False  # the thread is unmapping one, taken off `_dying`
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)  # notified once nothing is left to unmap
        self._wanted = threading.Event()  # work for the thread: chunks to unmap, or to make
        self._thread: threading.Thread | None = None  # (None while it has nothing to do)

    @property
    def available(self) -> int:
        return max(0, self.limit - self.used)

    @property
    def kept(self) -> int:
        return (len(self._freed) + len(self._made)) * CHUNK

    def reserve(self, nbytes: int) -> None:
        """Account `nbytes` more, or raise ENOSPC leaving nothing changed."""
        with self._lock:
            if self.used + nbytes > self.limit:  # the caller evicts, spills or fails, and says so
                raise OSError(errno.ENOSPC, "ckptfs RAM budget exhausted")
            self.used += nbytes
            while self.used + self.kept > self.limit:
                self._dying.append(self._made.pop() if self._made else self._freed.pop())
                self._wake()

    def unreserve(self, nbytes: int) -> None:
        self.used -= nbytes

    def take_chunk(self) -> mmap.mmap:
        chunk = self.take_kept() or new_chunk()
        self._top_up()
        return chunk

    def take_made(self) -> mmap.mmap | None:
        """A fresh chunk made ahead (all zeros), if any; from any thread: a
        load's worker takes them, its bytes reserved already (`Loading`)."""
        with self._lock:
            chunk = self._made.popleft() if self._made else None
        self._top_up()
        return chunk

    def take_kept(self) -> mmap.mmap | None:
        """A chunk of the stock, or one let go and not unmapped yet, if any
        (already faulted in)."""
        if self._freed:
            return self._freed.pop()
        if self._dying:
            with self._lock:
                if self._dying and len(self._dying[-1]) == CHUNK:
                    return self._dying.pop()
        with contextlib.suppress(IndexError):
            return self._made.popleft()
        return None

    def give_chunk(self, chunk: mmap.mmap) -> None:
        with self._lock:
            if len(chunk) != CHUNK:  # (a fitted last chunk) unmapped first: no write could take it
                self._dying.appendleft(chunk)
            elif self._has_room():
                self._freed.append(chunk)
                return
            else:
                self._dying.append(chunk)
            self._wake()

    def wait_returned(self, timeout: float) -> bool:
        """Wait until every chunk let go is unmapped (given back to the OS);
        False if some are not after `timeout` seconds."""
        with self._returned:
            return self._returned.wait_for(lambda: not self._dying and not self._unmapping, timeout)

    def _has_room(self) -> bool:
        """The stock may hold one chunk more."""
        return self.kept + CHUNK <= self.reuse and self.used + self.kept + CHUNK <= self.limit

    def _top_up(self) -> None:
        """A chunk was taken: have the thread make more ahead, if room."""
        with self._lock:
            if len(self._made) < self.made_ahead and self._has_room():
                self._wake()

    def _wake(self) -> None:
        """There is work for the pool's thread: start it if none runs (with
        `_lock` held). One that cannot start (the system's thread limit) is
        tried again at the next wake; meanwhile what waits to be unmapped is
        still what writes take first, and no write or delete fails for it."""
        self._wanted.set()
        if self._thread is None:
            thread = threading.Thread(target=self._tend, name="ckptfs-memory", daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:
                log.warning("the memory pool's thread did not start (%s): freed memory waits to go back to the OS", exc)
                return
            self._thread = thread

    def _tend(self) -> None:
        """The pool's thread: unmap what was let go, then fault in fresh
        chunks for the writes to come (`made_ahead`), the GIL let go in
        both; it ends once woken by nothing for `TEND_IDLE_S`."""
        while True:
            if not self._wanted.wait(TEND_IDLE_S):
                with self._lock:
                    if not self._wanted.is_set():
                        self._thread = None
                        return
                continue
            self._wanted.clear()
            while self._unmap_one():
                pass
            while not self._dying and len(self._made) < self.made_ahead and self._has_room() and self._make_one():
                pass

    def _unmap_one(self) -> bool:
        """Unmap the oldest chunk let go; False when there is none left."""
        with self._lock:
            if not self._dying:
                self._unmapping = False
                self._returned.notify_all()
                return False
            chunk = self._dying.popleft()
            self._unmapping = True
        _unmap(chunk)
        return True

    def _make_one(self) -> bool:
        """Add a fresh chunk to those made ahead; False if it could not be
        made, or is not wanted any more (the budget changed meanwhile)."""
        try:
            chunk = new_chunk()
        except (OSError, MemoryError) as exc:  # the system is short of memory: the writes make their own
            log.debug("no chunk made ahead: %s", exc)
            return False
        with self._lock:
            if not self._dying and len(self._made) < self.made_ahead and self._has_room():
                self._made.append(chunk)
                return True
        _unmap(chunk)
        return False


def new_chunk(size: int = CHUNK) -> mmap.mmap:
    """A chunk of fresh memory, faulted in (any thread: no accounting).

    Python's mmap holds the GIL through the system call, and faulting in
    4 MiB takes 1-1.5 ms on a VM: a worker thread that made a chunk with
    MAP_POPULATE held the event loop, and every FUSE reply, that long. It
    maps the chunk alone and faults it in through madvise, the GIL let go
    (MAP_POPULATE where the kernel is older than 5.14), a step at a time:
    the kernel's lock on the memory map is held through each step, and any
    thread that maps or unmaps memory meanwhile (the event loop making a
    chunk for a write, the allocator growing) waits for it. (Huge pages
    were tried: 0.2 ms a chunk once there are free ones, but a save into a
    mount holding 2 GiB already took 5.4 s where it took 2.0, the kernel
    compacting memory for them.)"""
    global _populate_write
    if not _populate_write:
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    chunk = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    at = ctypes.c_char.from_buffer(chunk)
    try:
        start = ctypes.addressof(at)
        for off in range(0, size, _POPULATE_STEP):
            if _libc.madvise(start + off, min(_POPULATE_STEP, size - off), _MADV_POPULATE_WRITE) != 0:
                _populate_write = ctypes.get_errno() != errno.EINVAL  # EINVAL: a kernel that has no such advice
                break  # (the rest faults in when touched)
    finally:
        del at  # (a buffer export: the chunk could not be closed while it lived)
    return chunk


def _unmap(chunk: mmap.mmap) -> None:
    """Return a chunk to the OS now, or, while a view of it lives on, when
    that view goes (mmap unmaps itself once nothing refers to it). A view
    can outlive its file: the traceback of a failed load or upload keeps the
    memoryviews its frames read through, and a store's client library may
    keep a failed request's body."""
    with contextlib.suppress(BufferError):
        chunk.close()


def _small_capacity(needed: int) -> int:
    cap = 64  # a 100-byte file holds 128 bytes, not a page: what 100,000 small files cost is mostly this
    while cap < needed:
        cap <<= 1
    return cap


class _Chunk:
    """One chunk of a file. Bytes at or beyond `hw` (the initialised prefix)
    may hold stale data from a recycled chunk and read as zeros.

    `refs` counts the holders: the live file and any snapshots. A chunk with
    more than one holder is frozen: a write copies it first (copy-on-write).
    """

    __slots__ = ("buf", "hw", "refs")

    def __init__(self, buf: mmap.mmap | bytearray, hw: int = 0) -> None:
        self.buf = buf
        self.hw = hw
        self.refs = 1


def _unref(chunk: _Chunk, pool: MemoryPool) -> None:
    chunk.refs -= 1
    if chunk.refs == 0:
        pool.unreserve(len(chunk.buf))
        if isinstance(chunk.buf, mmap.mmap):
            pool.give_chunk(chunk.buf)


class Snapshot:
    """The bytes of a file at one moment, shared copy-on-write with the file.

    Safe to read from worker threads: nothing writes a frozen chunk's buffer,
    each chunk's initialised length is taken now (a later shrinking truncate
    of the file lowers the file's own `hw`, never this), and the chunks stay
    allocated until `release()` (called on the owning thread).
    """

    def __init__(self, size: int, chunks: dict[int, _Chunk], pool: MemoryPool, start: int = 0,
                 stream: object | None = None) -> None:
        self.size = size
        self.start = start  # a multiple of CHUNK: the bytes before it are not part of this snapshot
        self.stream = stream  # the stream the file's first bytes were handed to, if they are unchanged since (`FileData.hand_out`)
        self._chunks = {idx: (c, c.hw) for idx, c in chunks.items()}
        self._pool = pool
        for c in chunks.values():
            c.refs += 1

    def tail(self, start: int) -> Snapshot:
        """The same bytes from `start` (a multiple of CHUNK) on, as a snapshot
        of its own (released on its own)."""
        assert start % CHUNK == 0 and start >= self.start
        tail = Snapshot(self.size, {}, self._pool, start)
        # This snapshot's `hw`s, not the chunks' own: a truncate may have lowered those since.
        tail._chunks = {idx: (c, hw) for idx, (c, hw) in self._chunks.items() if idx >= start // CHUNK}
        for c, _hw in tail._chunks.values():
            c.refs += 1
        return tail

    def pieces(self) -> Iterator[memoryview]:
        """The file's bytes in order (from `start`), as views, no copies;
        holes (and a chunk's uninitialised tail) as hole pieces."""
        for idx in range(self.start // CHUNK, (self.size + CHUNK - 1) // CHUNK):
            length = min(CHUNK, self.size - idx * CHUNK)
            chunk, hw = self._chunks.get(idx, (None, 0))
            valid = min(hw, length)
            if valid:
                yield memoryview(chunk.buf)[:valid]  # type: ignore[union-attr]
            if length > valid:
                yield from zeros(length - valid)

    def release(self) -> None:
        chunks, self._chunks = self._chunks, {}
        for c, _hw in chunks.values():
            _unref(c, self._pool)


class _SpillFile:
    """An unlinked file holding a spilled file's bytes; shared by the file and
    the snapshots taken of it, closed when the last of them lets go."""

    __slots__ = ("fd", "refs")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.refs = 1

    def unref(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            os.close(self.fd)
            self.fd = -1


class SpillCopy:
    """A file's bytes in RAM on their way into a spill file: `run` writes
    them (in a worker thread: gigabytes must not hold the event loop) from a
    snapshot, so the chunks stay allocated and unchanged meanwhile; then
    `FileData.spilled_to`, or `discard`."""

    def __init__(self, fd: int, directory: str, snapshot: Snapshot) -> None:
        self.fd, self.directory, self.snapshot = fd, directory, snapshot

    def run(self) -> None:
        off = 0
        for piece in self.snapshot.pieces():
            if not is_hole(piece):
                _pwrite_all(self.fd, piece, off)
            off += len(piece)
        os.ftruncate(self.fd, self.snapshot.size)

    def discard(self) -> None:
        """Give back the snapshot and the spill file, if not taken (owning thread)."""
        self.snapshot.release()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SpillSnapshot:
    """A sealed generation of a spilled file: a reference to its spill file,
    which nothing writes while this exists (a writer copies it first)."""

    def __init__(self, spill: _SpillFile, size: int) -> None:
        self.size = size
        self._spill: _SpillFile | None = spill
        spill.refs += 1

    def pieces(self) -> Iterator[memoryview | bytes]:
        assert self._spill is not None
        yield from read_sparse(self._spill.fd, self.size)

    def release(self) -> None:
        if self._spill is not None:
            self._spill.unref()
            self._spill = None


class FileData:
    """The contents of one regular file: `size` bytes, sparse, in chunks.

    A file whose bytes are safely in the store may be *evicted*: its chunks
    are dropped, its size kept, and it must be `fill`ed before use.

    A file too big for the RAM budget is *spilled*: its bytes move to an
    unlinked file in the spill directory and it is read and written there
    (at disk speed, no RAM held). Snapshots of a spilled file share the spill
    file; a write while one exists first copies it.

    An evicted file may be *borrowed* (`Borrowing`): read, not written,
    straight from its file in a local store. It stays evicted: a writer
    loads it first, and once it is resident the borrow ends.
    """

    __slots__ = ("_chunks", "_pool", "_spill", "_spill_dir", "allocated", "borrowed", "frontier", "handed", "loading", "resident", "size",
                 "stream")

    def __init__(self, pool: MemoryPool) -> None:
        self.size = 0
        self.allocated = 0
        self.resident = True
        self.loading: Loading | None = None  # an evicted file's bytes on their way back
        self.borrowed: Borrowing | None = None  # an evicted file's reads served from its file in a local store
        self._chunks: dict[int, _Chunk] = {}
        self._pool = pool
        self._spill: _SpillFile | None = None
        self._spill_dir = ""
        self.stream: object | None = None  # who holds `handed` (see `hand_out`)
        self.handed = 0
        # Where a writer going from the start got to: the end of the last of
        # writes each starting at or before the end of the ones before. It is
        # the size for appends, and less for a file sized first (ftruncate)
        # and then filled in order (safetensors).
        self.frontier = 0

    @property
    def spilled(self) -> bool:
        return self._spill is not None

    def spilled_bytes(self) -> int:
        """What the spill file takes on its disk (holes take nothing); 0 if
        the file is not spilled."""
        return os.fstat(self._spill.fd).st_blocks * 512 if self._spill is not None else 0

    def snapshot(self) -> Snapshot | SpillSnapshot:
        assert self.resident
        if self._spill is not None:
            return SpillSnapshot(self._spill, self.size)
        stream, self.stream = self.stream, None  # what it was handed is this snapshot's: bytes written next are not
        return Snapshot(self.size, dict(self._chunks), self._pool, stream=stream)

    def hand_out(self, stream: object, end: int) -> Snapshot:
        """The bytes from what `stream` was handed last up to `end` (both
        multiples of CHUNK), which are now promised to it: while no write or
        truncation changes the first `end` bytes, this file's snapshots name
        `stream` (so that whoever staged them need not read them again)."""
        assert self._spill is None and self.resident and end % CHUNK == 0 and end <= self.frontier <= self.size
        if self.stream is not stream:
            self.stream, self.handed = stream, 0
        start, self.handed = self.handed, end
        return Snapshot(end, {idx: c for idx, c in self._chunks.items() if start // CHUNK <= idx < end // CHUNK}, self._pool, start)

    def spill(self, directory: str) -> None:
        """Move the bytes out of RAM into an unlinked file in `directory`."""
        copy = self.spill_copy(directory)
        try:
            copy.run()
        except BaseException:
            copy.discard()
            raise
        self.spilled_to(copy)

    def spill_copy(self, directory: str) -> SpillCopy:
        """The bytes as they are now, to be copied into a new unlinked file in
        `directory` (`SpillCopy.run`, in any thread), then `spilled_to`."""
        assert self._spill is None and self.resident
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
        return SpillCopy(fd, directory, Snapshot(self.size, dict(self._chunks), self._pool))

    def spilled_to(self, copy: SpillCopy) -> None:
        """Continue in the spill file `copy` made (the caller knows the file
        did not change since `spill_copy`)."""
        size = self.size
        self.clear()
        self.size = size
        self._spill, self._spill_dir = _SpillFile(copy.fd), copy.directory
        copy.fd = -1
        copy.discard()

    def _thaw(self) -> _SpillFile:
        """Before changing a spilled file: if a snapshot shares its spill
        file, continue in a copy (the snapshot keeps the original)."""
        spill = self._spill
        assert spill is not None
        if spill.refs == 1:
            return spill
        new = os.open(self._spill_dir, os.O_TMPFILE | os.O_RDWR, 0o600)
        try:
            off = 0
            while off < self.size:
                n = os.copy_file_range(spill.fd, new, self.size - off, off, off)
                if n <= 0:
                    break
                off += n
            os.ftruncate(new, self.size)
        except BaseException:
            os.close(new)
            raise
        spill.unref()
        self._spill = _SpillFile(new)
        return self._spill

    def evict(self, keep_borrow: bool = False) -> None:
        """Drop the bytes from RAM, or the spill file (the caller knows they
        are in the store); `keep_borrow`: a borrow serving reads goes on."""
        self._free()
        self.resident = False
        if not keep_borrow:
            self.unborrow()


    # -- reads ---------------------------------------------------------------
    def read(self, off: int, size: int) -> bytes | bytearray | memoryview:
        """The bytes `off`..`off + size`. Within one large chunk this is a
        view of the file's memory, not a copy: it is valid only until the
        file next changes (a FUSE reply is sent before that). A borrowed
        file's bytes that are not in the page cache raise `WouldBlock`."""
        end = min(off + size, self.size)
        if off >= end:
            return b""
        if not self.resident and self.borrowed is not None and self.borrowed.covers(off, end):
            return self.borrowed.read(off, end)
        if self._spill is not None:
            data = os.pread(self._spill.fd, end - off, off)
            return data + bytes(end - off - len(data))
        idx, lo = divmod(off, CHUNK)
        if lo + (end - off) <= CHUNK:  # the common case: one chunk, no copy
            chunk = self._chunks.get(idx)
            if chunk is not None and isinstance(chunk.buf, mmap.mmap) and lo + (end - off) <= chunk.hw:
                return memoryview(chunk.buf)[lo : lo + end - off]
            return self._piece(idx, lo, lo + end - off)
        parts = []
        pos = off
        while pos < end:
            idx, lo = divmod(pos, CHUNK)
            hi = min(CHUNK, lo + end - pos)
            parts.append(self._piece(idx, lo, hi))
            pos += hi - lo
        return b"".join(parts)

    def _piece(self, idx: int, lo: int, hi: int) -> bytes:
        chunk = self._chunks.get(idx)
        if chunk is None or lo >= chunk.hw:
            return ZEROS[: hi - lo]
        if hi <= chunk.hw:
            return _slice(chunk.buf, lo, hi)
        return _slice(chunk.buf, lo, chunk.hw) + ZEROS[: hi - chunk.hw]

    # -- writes --------------------------------------------------------------
    def write(self, off: int, data: bytes | memoryview) -> int:
        """Write all of `data` at `off` (zero-filling any gap), or raise ENOSPC
        having changed nothing."""
        n = len(data)
        if n == 0:
            return 0
        end = off + n
        if off < self.handed:
            self.stream = None  # the promise is broken
        if off <= self.frontier < end:
            self.frontier = end
        if self._spill is not None:
            fd = self._thaw().fd
            try:
                _pwrite_all(fd, memoryview(data), off)
            except OSError:
                if end > self.size:  # what got past the end before the disk filled must not show up later
                    os.ftruncate(fd, self.size)
                raise
            self.size = max(self.size, end)
            return n
        self._reserve_for(off, end)
        src = memoryview(data)
        pos = off
        while pos < end:
            idx, lo = divmod(pos, CHUNK)
            hi = min(CHUNK, lo + end - pos)
            chunk = self._chunk_for_write(idx, hi)
            if lo > chunk.hw:
                chunk.buf[chunk.hw : lo] = ZEROS[: lo - chunk.hw]
            chunk.buf[lo:hi] = src[pos - off : pos - off + hi - lo]
            chunk.hw = max(chunk.hw, hi)
            pos += hi - lo
        self.size = max(self.size, end)
        return n

    def _reserve_for(self, off: int, end: int) -> None:
        need = 0
        pos = off
        while pos < end:
            idx, lo = divmod(pos, CHUNK)
            hi = min(CHUNK, lo + end - pos)
            chunk = self._chunks.get(idx)
            if chunk is not None and chunk.refs > 1:
                need += _capacity(max(hi, chunk.hw))  # copy-on-write
            else:
                have = len(chunk.buf) if chunk is not None else 0
                if hi > have:
                    need += _capacity(hi) - have
            pos += hi - lo
        if need:
            self._pool.reserve(need)
            self.allocated += need

    def fit(self) -> None:
        """Let the last chunk take what a load would give it (`_fitted`), not
        a whole CHUNK: a writer's chunks are CHUNKs, as it does not know the
        final size, and at a seal the size is likely final (a file of 300 KiB
        written took 4 MiB of the budget). A large chunk is shrunk where it
        is (mremap: no copy), a small one copied (at most SMALL_MAX bytes);
        nothing changes while a snapshot or a view shares the chunk. A later
        write past its end grows it again (a large one with no copy)."""
        if self._spill is not None or not self.resident or not self.size:
            return
        idx = (self.size - 1) // CHUNK
        chunk = self._chunks.get(idx)
        if chunk is None or chunk.refs > 1 or not isinstance(chunk.buf, mmap.mmap):
            return
        old = len(chunk.buf)
        cap = _fitted(max(chunk.hw, 1))
        if cap >= old:
            return
        if cap <= SMALL_MAX:
            buf = bytearray(cap)
            buf[: chunk.hw] = memoryview(chunk.buf)[: chunk.hw]
            big, chunk.buf = chunk.buf, buf
        else:
            try:
                chunk.buf.resize(cap)
            except BufferError:  # a view of it lives on (a reply being sent)
                return
            big = None
        self._pool.unreserve(old - cap)
        self.allocated -= old - cap
        if big is not None:
            self._pool.give_chunk(big)

    def _chunk_for_write(self, idx: int, hi: int) -> _Chunk:
        """The chunk `idx`, grown to hold `hi` bytes (already reserved)."""
        chunk = self._chunks.get(idx)
        if chunk is not None and chunk.refs == 1 and hi <= len(chunk.buf):
            return chunk
        cap = _capacity(max(hi, chunk.hw if chunk is not None else 0))
        if chunk is not None and chunk.refs == 1 and isinstance(chunk.buf, mmap.mmap):
            # a chunk fitted to its length (`fit`, or a load's last): grown where it is or moved, never copied
            with contextlib.suppress(BufferError):  # (while a view of it lives on: copied)
                chunk.buf.resize(cap)
                return chunk
        buf: mmap.mmap | bytearray = self._pool.take_chunk() if cap == CHUNK else bytearray(cap)
        if chunk is None:
            chunk = self._chunks[idx] = _Chunk(buf)
            return chunk
        buf[: chunk.hw] = memoryview(chunk.buf)[: chunk.hw]
        if chunk.refs > 1:  # frozen by a snapshot: leave it to the snapshot
            self.allocated -= len(chunk.buf)
            chunk.refs -= 1
            chunk = self._chunks[idx] = _Chunk(buf, chunk.hw)
        else:  # a small chunk outgrew its buffer
            chunk.buf = buf
        return chunk

    def truncate(self, size: int) -> None:
        if size < self.handed:
            self.stream = None
        self.frontier = min(self.frontier, size)
        if self._spill is not None:
            os.ftruncate(self._thaw().fd, size)
            self.size = size
            return
        if size < self.size:
            last, lo = divmod(size, CHUNK)
            for idx in [i for i in self._chunks if i > last or (i == last and lo == 0)]:
                self._drop(idx)
            chunk = self._chunks.get(last)
            if chunk is not None and chunk.hw > lo:
                chunk.hw = lo  # snapshots keep their own copy of `hw`; a write copies a shared chunk first
        self.size = size

    def clear(self) -> None:
        """Free every chunk (the file was truncated to zero or deleted). An
        evicted file is resident again, and empty: nothing needs loading."""
        self._free()
        self.size = 0
        self.resident = True
        self.unborrow()

    def _free(self) -> None:
        for idx in list(self._chunks):
            self._drop(idx)
        if self._spill is not None:
            self._spill.unref()  # snapshots keep their own reference
            self._spill = None
        self.stream, self.handed, self.frontier = None, 0, 0
        self.loading = None  # a load in progress is fenced out

    def unborrow(self) -> None:
        """End the borrow, if any (a borrow's load under way is fenced out)."""
        if self.borrowed is not None:
            self.borrowed.release()

    def _drop(self, idx: int) -> None:
        chunk = self._chunks.pop(idx)
        self.allocated -= len(chunk.buf)
        _unref(chunk, self._pool)


class Loading:
    """An evicted file's bytes on their way back from the store.

    `view` and `place` run in the load's worker thread: they put bytes, at
    any offset and in any order, into chunks of their own (not yet the
    file's) or into a spill file, and keep holes as holes. `show` runs on
    the owning thread once a range is verified: the file serves reads there
    (`covers`); once every chunk is shown it is resident. Nothing else
    touches the file meanwhile (the caller fences writers); a truncate or
    delete of the file drops the load (`data.loading` no longer names it)
    and `release` returns what it held.

    In RAM, the budget for the whole file is reserved up front and what
    holes did not use is returned at the end; a file the budget cannot take
    is loaded into a spill file instead.
    """

    in_place = False

    def __init__(self, data: FileData, spill_dir: str | None) -> None:
        assert not data.resident and data.loading is None
        self.size = data.size
        self.cancelled = False  # the worker thread stops at its next piece
        self._data = data
        self._pending: dict[int, _Chunk] = {}
        self._shown = bytearray(-(-self.size // CHUNK))  # per chunk: 1 once served
        self._unshown = len(self._shown)
        self._reserved = 0
        self.spilled = spill_dir is not None
        self._fd = -1  # the worker's own descriptor of the spill file: closed by the worker (`close`), never reused under it
        if spill_dir is not None:
            fd = os.open(spill_dir, os.O_TMPFILE | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, self.size)
                self._fd = os.dup(fd)
            except BaseException:
                os.close(fd)
                raise
            data._spill, data._spill_dir = _SpillFile(fd), spill_dir
        else:
            self._reserved = ram_for(self.size)
            data._pool.reserve(self._reserved)  # ENOSPC: the caller spills instead
        data.loading = self

    def close(self) -> None:
        """The worker is done with the file (worker thread)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _chunk(self, idx: int) -> _Chunk:
        chunk = self._pending.get(idx)
        if chunk is None:
            length = min(CHUNK, self.size - idx * CHUNK)
            cap = _fitted(length)
            if cap == CHUNK:  # (made ahead by the pool's thread while this one reads, if it keeps up)
                buf: mmap.mmap | bytearray = self._data._pool.take_made() or new_chunk()
            else:
                buf = new_chunk(cap) if cap > SMALL_MAX else bytearray(cap)
            chunk = self._pending[idx] = _Chunk(buf, length)  # fresh memory: what no piece writes reads as zeros
        return chunk

    def view(self, off: int, n: int) -> memoryview | None:
        """Where a reader may put up to `n` of the file's bytes at `off`
        itself (worker thread); None in a spill file (`place` writes it)."""
        if self._fd >= 0 or self.cancelled or not 0 <= off < self.size:
            return None
        idx, lo = divmod(off, CHUNK)
        chunk = self._chunk(idx)
        return memoryview(chunk.buf)[lo : min(lo + n, chunk.hw)]

    def place(self, off: int, piece: memoryview | bytes) -> None:
        """The file's bytes at `off` (worker thread); a piece that `view`
        gave is in place already."""
        view = memoryview(piece).cast("B")
        if off + len(view) > self.size:
            raise OSError(errno.EIO, f"the store holds more than the file's {self.size} bytes")
        if is_hole(piece):
            return
        if self._fd >= 0:
            _pwrite_all(self._fd, view, off)
            return
        while view:
            idx, lo = divmod(off, CHUNK)
            k = min(len(view), CHUNK - lo)
            chunk = self._chunk(idx)
            if view.obj is not chunk.buf:
                chunk.buf[lo : lo + k] = view[:k]
            off += k
            view = view[k:]

    def covers(self, off: int, end: int | None) -> bool:
        """Whether the bytes `off`..`end` (None: all) are served."""
        if end is None or not self._unshown:
            return not self._unshown
        end = min(end, self.size)
        return off >= end or all(self._shown[off // CHUNK : -(-end // CHUNK)])

    def show(self, off: int, end: int) -> bool:
        """Serve the bytes `off`..`end`, verified (owning thread): whole
        chunks, or up to the end of the file. False if the load was dropped
        meanwhile."""
        data = self._data
        if self.cancelled or data.loading is not self:
            return False
        end = min(end, self.size)
        assert off % CHUNK == 0 and (end % CHUNK == 0 or end == self.size)
        for idx in range(off // CHUNK, -(-end // CHUNK)):
            if self._shown[idx]:
                continue
            self._shown[idx] = 1
            self._unshown -= 1
            chunk = self._pending.pop(idx, None)
            if chunk is not None:
                data._chunks[idx] = chunk
                data.allocated += len(chunk.buf)
                self._reserved -= len(chunk.buf)
        if not self._unshown:
            data.resident = True
            data.loading = None
            data.unborrow()  # what it served is in RAM now
            self.release()
        return True

    def release(self) -> None:
        """Stop and give back what the load holds (owning thread; idempotent)."""
        self.cancelled = True
        if self._reserved:
            self._data._pool.unreserve(self._reserved)
            self._reserved = 0
        self._pending.clear()  # unmapped as they go (fresh chunks, never the pool's)
        if self._data.loading is self:  # dropped before the end: evicted again, nothing half-loaded stays
            self._data.loading = None
            self._data.evict(keep_borrow=True)  # (reads served in place go on: the file may have no other copy)


class Borrowing:
    """An evicted file read in place: from its file in a local store, which
    ckptfs never writes in place (a new generation is a new file renamed over
    the old one), through a descriptor of that very file (the name may move
    on, the bytes stay).

    A load verifies it block by block, as it would into RAM, and `show`
    serves each verified range. Nothing of the file goes into RAM for good,
    and a file larger than the RAM budget needs no spill file. If the store
    file's size or mtime change (someone wrote it in place), the borrow ends
    (`covers` says no): the next read loads and verifies it again.

    Where a block is verified, reads of it are served: the last few blocks
    verified are *held* (`hold`: read into chunks of the RAM budget, up to
    HELD_BYTES at a time) and reads of a held block are answered from those
    chunks without a copy; other blocks go through one small scratch buffer
    (`view`) and their reads come from the store file's page cache. A held block is
    let go once reads went past it (its pages in the store file's page cache
    go too: what the mount serves is in the mount's own page cache by then),
    or once no read came for HELD_IDLE_S; a load that would hold one more
    block waits for that (`hold` says None), so it keeps pace with its
    reader instead of running ahead of it through the page cache. It waits
    HELD_MAX_S at most per block: a load's deadline allows for a store's
    slowest rate, and waiting on a slow reader must not use that up.
    """

    spilled = False
    in_place = True

    def __init__(self, data: FileData) -> None:
        assert not data.resident and data.borrowed is None
        self.size = data.size
        self.cancelled = False  # the worker thread stops at its next piece
        self._data = data
        self._pool = data._pool
        self._fd = -1  # the store file, once the load opened it (`adopt`)
        self._stamp: tuple[int, int] | None = None
        self._nowait = True  # reads try the page cache alone first (RWF_NOWAIT)
        self._scratch: bytearray | None = None  # the worker's: what it verifies goes through here
        self._shown = bytearray(-(-self.size // CHUNK))  # per chunk: 1 once served
        self._unshown = len(self._shown)
        self._filling: _Held | None = None  # the block the worker reads into chunks now
        self._held: list[_Held] = []  # verified blocks whose reads are answered from their chunks, oldest first
        self._read_at = time.monotonic()  # when the file was last read (or the borrow began)
        self.dropped: list[tuple[int, int]] = []  # ranges of the store file read past: the worker lets their pages go
        data.borrowed = self

    def adopt(self, fd: int, opened: os.stat_result | None = None) -> None:
        """The load opened the store file: this descriptor (a copy, ours
        from now on) serves the reads (owning thread, before any `show`).
        `opened`: the file's status when the load opened it, before it read
        a byte (None: now); a write in place after that ends the borrow."""
        if self.cancelled or self._data.borrowed is not self:
            os.close(fd)
            return
        stamp = _stamp(os.fstat(fd) if opened is None else opened)  # if this fails, the descriptor is still the caller's
        self._fd, self._stamp = fd, stamp

    def close(self) -> None:
        """The worker is done with the file (worker thread)."""
        self._scratch = None

    def hold(self, off: int, n: int, pressed: bool) -> bool | None:
        """Owning thread, before the worker reads the block `off`..`off + n`:
        True if it goes into chunks of its own (then held once shown); False
        if through the scratch buffer (RAM is short, or the borrow ended);
        None: wait a moment and ask again (HELD_BYTES are held, and their
        reader is still at them). `pressed`: a reader waits for bytes not
        served yet, and the oldest held block goes now."""
        self._put_back(self._filling)  # a block that failed its check is never shown
        self._filling = None
        if self.cancelled or self._unshown == len(self._shown):
            # The first block a reader waits for goes through the scratch buffer: no fresh
            # memory before its first byte is served, and small reads (`view`).
            return False
        while self._held and sum(held.end - held.start for held in self._held) + n > HELD_BYTES:
            oldest, now = self._held[0], time.monotonic()
            if not (pressed or now - self._read_at > HELD_IDLE_S or now - oldest.since > HELD_MAX_S):
                return None
            self._let_go(oldest)
        need = -(-n // CHUNK)
        try:
            self._pool.reserve(need * CHUNK)
        except OSError:  # the budget is the files': this block goes through the page cache
            return False
        self._filling = _Held(off, off + n, [self._pool.take_kept() for _ in range(need)])  # the rest: fresh, made by the worker
        return True

    def view(self, off: int, n: int) -> memoryview | None:
        """Where the worker reads the next piece to verify (worker thread):
        the block's own chunks if it is held, else the same small scratch
        buffer every time; `place` keeps nothing.

        The scratch takes SCRATCH bytes at a time. The first block a reader
        waits for goes through it, and small reads bring a block's bytes
        sooner than large ones: the kernel's read-ahead starts small and
        grows while they are hashed, where one large read waits for all of
        its bytes (16 MiB of a cold file: 8-9 ms in reads of 64-256 KiB,
        13-14 ms in reads of 4-8 MiB; the first 4 KiB from a fresh mount:
        11.8 ms against 17.6 ms through a 4 MiB scratch)."""
        if self.cancelled:
            return None
        filling = self._filling
        if filling is not None and filling.start <= off < filling.end:
            idx, lo = divmod(off - filling.start, CHUNK)
            if filling.chunks[idx] is None:  # made ahead by the pool's thread, or faulted in here: off the event loop
                filling.chunks[idx] = self._pool.take_made() or new_chunk()
            return memoryview(filling.chunks[idx])[lo : lo + min(n, CHUNK - lo, filling.end - off)]
        if self._scratch is None:
            self._scratch = bytearray(SCRATCH)
        return memoryview(self._scratch)[: min(n, SCRATCH)]

    def place(self, off: int, piece: memoryview | bytes) -> None:
        if off + len(piece) > self.size:
            raise OSError(errno.EIO, f"the store holds more than the file's {self.size} bytes")
        filling = self._filling
        if filling is not None and filling.start <= off < filling.end and is_hole(piece):
            filling.whole = False  # a hole was not read into the chunks: its reads go to the store file

    def covers(self, off: int, end: int | None) -> bool:
        """Whether the bytes `off`..`end` (None: all) are served, from a store
        file unchanged since it was verified (if it changed, the borrow ends)."""
        if end is not None and off >= min(end, self.size):
            return True
        if self._fd < 0:
            return False
        if self._stamp != _stamp(os.fstat(self._fd)):
            log.warning("a file in the store changed in place while reads were served from it: verifying it again")
            self.release()
            return False
        if end is None or not self._unshown:
            return not self._unshown
        return all(self._shown[off // CHUNK : -(-min(end, self.size) // CHUNK)])

    def show(self, off: int, end: int) -> bool:
        """Serve the bytes `off`..`end`, verified (owning thread). False if
        the borrow ended meanwhile."""
        if self.cancelled or self._data.borrowed is not self or self._fd < 0:
            return False
        end = min(end, self.size)
        filling, self._filling = self._filling, None
        if filling is not None and filling.start == off and filling.end == end and filling.whole:
            filling.since = time.monotonic()
            self._held.append(filling)
        else:
            self._put_back(filling)
        for idx in range(off // CHUNK, -(-end // CHUNK)):
            if not self._shown[idx]:
                self._shown[idx] = 1
                self._unshown -= 1
        return True

    def let_go_held(self) -> int:
        """Let go of every block held (RAM is wanted for files: the reader
        reads on from the store file); returns the bytes freed."""
        freed = sum(len(held.chunks) for held in self._held) * CHUNK
        for held in list(self._held):
            self._let_go(held)
        return freed

    def let_go_idle(self) -> float | None:
        """Let go of the held blocks if no read came for them lately
        (owning thread); None if none is held now, else when to look again
        (seconds)."""
        idle = time.monotonic() - self._read_at
        if idle >= HELD_IDLE_S:
            for held in list(self._held):
                self._let_go(held)
        return HELD_IDLE_S - idle if self._held else None

    def read(self, off: int, end: int) -> bytes | bytearray | memoryview:
        """The bytes `off`..`end`: a view of a held block's chunks (valid
        until the owning thread's next step), or from the store file if
        its page cache has them all (just verified, they mostly are); else
        `WouldBlock`: the caller reads them off its thread (a store on a
        network file system could hold the event loop, and every other
        request, for as long)."""
        self._read_at = time.monotonic()
        for held in [h for h in self._held if h.end <= off]:  # read past: not read again (the mount's page cache has it)
            self._let_go(held, True)
        for held in self._held:
            if held.start <= off and end <= held.end:
                return held.read(off, end)
        if self._nowait:
            buf = bytearray(end - off)
            try:
                if os.preadv(self._fd, [buf], off, os.RWF_NOWAIT) == len(buf):
                    return buf
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                self._nowait = False  # this file system cannot say: every read goes off the thread
        raise WouldBlock(self, off, end)

    @property
    def fd(self) -> int:
        return self._fd

    def release(self) -> None:
        """End the borrow (owning thread; idempotent)."""
        self.cancelled = True
        for held in list(self._held):
            self._let_go(held)
        self._put_back(self._filling, reuse=False)  # the worker may be reading into it still
        self._filling = None
        if self._data.borrowed is self:
            self._data.borrowed = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _let_go(self, held: _Held, read_past: bool = False) -> None:
        self._held.remove(held)
        self._put_back(held)
        if read_past:
            self.dropped.append((held.start, held.end - held.start))

    def _put_back(self, held: _Held | None, reuse: bool = True) -> None:
        """A block's chunks go back to the budget, and to its stock of chunks
        to reuse. A view of them handed to a FUSE reply is gone by then: the
        reply is sent in the same step of the owning thread as the read that
        made it. `reuse` False: the worker may still be writing into them;
        each is unmapped once nothing refers to it any more."""
        if held is None:
            return
        self._pool.unreserve(len(held.chunks) * CHUNK)
        if reuse:
            for chunk in held.chunks:
                if chunk is not None:
                    self._pool.give_chunk(chunk)


class _Held:
    """A block of a borrowed file read into chunks: the bytes `start`..`end`."""

    __slots__ = ("chunks", "end", "since", "start", "whole")

    def __init__(self, start: int, end: int, chunks: list[mmap.mmap | None]) -> None:
        self.start, self.end, self.chunks = start, end, chunks
        self.whole = True  # every byte was read into the chunks (no hole left out)
        self.since = 0.0  # when it was shown

    def read(self, off: int, end: int) -> memoryview | bytes:
        idx, lo = divmod(off - self.start, CHUNK)
        if lo + end - off <= CHUNK:  # within one chunk: a view, no copy
            return memoryview(self.chunks[idx])[lo : lo + end - off]
        parts, pos = [], off
        while pos < end:
            idx, lo = divmod(pos - self.start, CHUNK)
            hi = min(CHUNK, lo + end - pos)
            parts.append(memoryview(self.chunks[idx])[lo:hi])
            pos += hi - lo
        return b"".join(parts)


class WouldBlock(Exception):
    """A read of a borrowed file would wait for the store's disk: run what
    `reader()` gives in a worker thread (it reads from a descriptor of its
    own), then ask `still_served` on the owning thread before using the bytes."""

    def __init__(self, borrowing: Borrowing, off: int, end: int) -> None:
        super().__init__("a read that waits for the store's disk")
        self.borrowing, self.off, self.end = borrowing, off, end

    def reader(self) -> Callable[[], bytes]:
        """The blocking read (owning thread: the descriptor is copied now, so
        the borrow may end meanwhile)."""
        fd, off, n = os.dup(self.borrowing.fd), self.off, self.end - self.off

        def read() -> bytes:
            try:
                data = os.pread(fd, n, off)
            finally:
                os.close(fd)
            return data + bytes(n - len(data))

        return read

    def still_served(self) -> bool:
        """Whether the borrow still serves these bytes from the same, unchanged
        store file (else the read starts again)."""
        return self.borrowing.covers(self.off, self.end)


def _stamp(st: os.stat_result) -> tuple[int, int]:
    """What a write in place changes (not the ctime: the publisher's chmod
    and rename of the file change that)."""
    return st.st_size, st.st_mtime_ns


def _pwrite_all(fd: int, view: memoryview, off: int) -> None:
    while view:
        n = os.pwrite(fd, view, off)
        view, off = view[n:], off + n


def ram_for(size: int) -> int:
    """What a file of `size` bytes takes of the RAM budget loaded whole (a
    load reserves that much up front): the capacity of each chunk."""
    return sum(_fitted(min(CHUNK, size - i * CHUNK)) for i in range(-(-size // CHUNK)))


def _fitted(length: int) -> int:
    """The capacity of a chunk whose length is known and final (a load's):
    a chunk of its own size, in pages, up to half a CHUNK (a file of 5 MiB
    takes 5 MiB, not 8); a CHUNK beyond, to be recycled."""
    if length <= SMALL_MAX:
        return _small_capacity(length)
    return CHUNK if length > CHUNK // 2 else -(-length // mmap.PAGESIZE) * mmap.PAGESIZE


def _capacity(needed: int) -> int:
    return CHUNK if needed > SMALL_MAX else _small_capacity(needed)


def _slice(buf: mmap.mmap | bytearray, lo: int, hi: int) -> bytes:
    if isinstance(buf, mmap.mmap):
        return buf[lo:hi]  # mmap slicing copies once, straight into bytes
    return bytes(memoryview(buf)[lo:hi])


def total_ram(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The memory this process may use: the machine's, or less where a
    cgroup caps it (a container's limit: Kubernetes, Docker, systemd). Past
    that, the kernel kills the daemon for memory, with every file it has
    not published yet."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min([physical, *_cgroup_limits(proc_cgroup, cgroup_root)])


def _cgroup_limits(proc_cgroup: str, cgroup_root: str) -> list[int]:
    """The memory limits of this process's cgroup and of each cgroup above
    it, those this process can see (cgroup v2's memory.max, v1's
    memory.limit_in_bytes; in a container the cgroup's own path is often not
    visible, and its limit is at the root of what is)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    limits = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            base, name = cgroup_root, "memory.max"  # v2
        elif "memory" in controllers.split(","):
            base, name = os.path.join(cgroup_root, "memory"), "memory.limit_in_bytes"  # v1
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            try:
                with open(os.path.join(base, *parts[:depth], name)) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text.isdigit():  # v2 writes "max" for none; v1 a number near 2^63
                limits.append(int(text))
    return limits
