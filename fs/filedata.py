"""A file's contents.

`FileData` holds one file's bytes as sparse fixed-size chunks (`memory.Chunk`), shared copy-on-write with `Snapshot`s
(what write-back reads from worker threads); a file continued on disk when
RAM is full is a spill file (`SpillCopy`, `SpillSnapshot`). Nothing here
knows about FUSE, inodes or paths.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ckptfs.holes import ZEROS, is_hole, read_sparse, zeros

from .memory import CHUNK, SMALL_MAX, Chunk, MemoryPool, capacity, fitted, unref

if TYPE_CHECKING:
    from .loading import Borrowing, Loading


class Snapshot:
    """The bytes of a file at one moment, shared copy-on-write with the file.

    Safe to read from worker threads: nothing writes a frozen chunk's buffer,
    each chunk's initialised length is taken now (a later shrinking truncate
    of the file lowers the file's own `hw`, never this), and the chunks stay
    allocated until `release()` (called on the owning thread).
    """

    def __init__(self, size: int, chunks: dict[int, Chunk], pool: MemoryPool, start: int = 0,
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
            unref(c, self._pool)


class SpillFile:
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
                pwrite_all(self.fd, piece, off)
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

    def __init__(self, spill: SpillFile, size: int) -> None:
        self.size = size
        self._spill: SpillFile | None = spill
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
        self._chunks: dict[int, Chunk] = {}
        self._pool = pool
        self._spill: SpillFile | None = None
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
        self._spill, self._spill_dir = SpillFile(copy.fd), copy.directory
        copy.fd = -1
        copy.discard()

    def _thaw(self) -> SpillFile:
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
        self._spill = SpillFile(new)
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
        if self.loading is not None and (lead := self.loading.read_lead(off, end)) is not None:
            return lead
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
                pwrite_all(fd, memoryview(data), off)
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
                need += capacity(max(hi, chunk.hw))  # copy-on-write
            else:
                have = len(chunk.buf) if chunk is not None else 0
                if hi > have:
                    need += capacity(hi) - have
            pos += hi - lo
        if need:
            self._pool.reserve(need)
            self.allocated += need

    def fit(self) -> None:
        """Let the last chunk take what a load would give it (`fitted`), not
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
        cap = fitted(max(chunk.hw, 1))
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

    def _chunk_for_write(self, idx: int, hi: int) -> Chunk:
        """The chunk `idx`, grown to hold `hi` bytes (already reserved)."""
        chunk = self._chunks.get(idx)
        if chunk is not None and chunk.refs == 1 and hi <= len(chunk.buf):
            return chunk
        cap = capacity(max(hi, chunk.hw if chunk is not None else 0))
        if chunk is not None and chunk.refs == 1 and isinstance(chunk.buf, mmap.mmap):
            # a chunk fitted to its length (`fit`, or a load's last): grown where it is or moved, never copied
            with contextlib.suppress(BufferError):  # (while a view of it lives on: copied)
                chunk.buf.resize(cap)
                return chunk
        buf: mmap.mmap | bytearray = self._pool.take_chunk() if cap == CHUNK else bytearray(cap)
        if chunk is None:
            chunk = self._chunks[idx] = Chunk(buf)
            return chunk
        buf[: chunk.hw] = memoryview(chunk.buf)[: chunk.hw]
        if chunk.refs > 1:  # frozen by a snapshot: leave it to the snapshot
            self.allocated -= len(chunk.buf)
            chunk.refs -= 1
            chunk = self._chunks[idx] = Chunk(buf, chunk.hw)
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
        unref(chunk, self._pool)


def pwrite_all(fd: int, view: memoryview, off: int) -> None:
    while view:
        n = os.pwrite(fd, view, off)
        view, off = view[n:], off + n


def _slice(buf: mmap.mmap | bytearray, lo: int, hi: int) -> bytes:
    if isinstance(buf, mmap.mmap):
        return buf[lo:hi]  # mmap slicing copies once, straight into bytes
    return bytes(memoryview(buf)[lo:hi])
