"""Holes: runs of zeros that nothing needs to store, hash from fresh memory,
or hold in RAM.

A file's bytes travel as a sequence of pieces (views). A piece that is a
view of `ZEROS` is a *hole*: the file system yields one where it holds no
data, a local store skips it with a seek (the store file stays sparse),
a local store's read yields one where the file has a hole, and a load keeps
no memory for it. Hashing a hole reads this one shared buffer.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator

ZEROS = bytes(4 << 20)
_VIEW = memoryview(ZEROS)


def is_hole(piece: memoryview | bytes) -> bool:
    return isinstance(piece, memoryview) and piece.obj is ZEROS


def zeros(n: int) -> Iterator[memoryview]:
    """`n` zero bytes as hole pieces."""
    while n > 0:
        k = min(n, len(ZEROS))
        yield _VIEW[:k]
        n -= k


def read_sparse(fd: int, size: int, piece: int = 8 << 20, start: int = 0,
                into: Callable[[int, int], memoryview | None] | None = None) -> Iterator[memoryview | bytes]:
    """The bytes `start`..`size` of the file `fd` in order, holes as hole
    pieces (found with SEEK_DATA/SEEK_HOLE; a file system without them reads
    as dense). Data is read straight into `into(offset, n)` where that gives
    a buffer (a writable view of at most `n` bytes for that offset; the piece
    yielded is that view), else into new bytes."""
    off = start
    while off < size:
        try:
            data = min(os.lseek(fd, off, os.SEEK_DATA), size)
        except OSError as exc:  # ENXIO: a hole up to the end; anything else: no SEEK_DATA here, read it all
            data = size if exc.errno == errno.ENXIO else off
        if data > off:
            yield from zeros(data - off)
            off = data
            continue
        try:
            end = min(os.lseek(fd, off, os.SEEK_HOLE), size)
        except OSError:
            end = size
        end = max(end, off + 1)  # a file grown since: read on
        while off < end:
            buf = into(off, min(piece, end - off)) if into is not None else None
            if buf is None:
                got: memoryview | bytes = os.pread(fd, min(piece, end - off), off)
            else:
                got = buf[: os.preadv(fd, [buf], off)]
            if not got:
                raise OSError(errno.EIO, "file shorter than expected")
            off += len(got)
            yield got
