"""Blocking store I/O: the steps the engine runs in worker threads, and the
same steps for a whole file written or read straight from the store (the
torch helpers' fallback when the daemon cannot serve, C7).

Each publication writes the manifest record first, then makes the data
visible (see manifest.py), so a store never holds a file its manifest cannot
vouch for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from . import manifest
from .backend import Backend, Staged
from .manifest import Digest, Record

PIECE = 8 << 20


class Cancelled(Exception):
    """The generation being staged was dropped: stop reading its snapshot."""


class IntegrityError(OSError):
    """Bytes read from the store do not match their manifest record."""


def stage(backend: Backend, pieces: Iterable[memoryview | bytes], size: int, path: str,
          cancelled: Callable[[], bool] | None = None) -> tuple[Staged, Digest]:
    """Upload `pieces` invisibly for `path`, hashing them on the way."""
    h = manifest.hasher()

    def hashed():
        for piece in pieces:
            if cancelled is not None and cancelled():
                raise Cancelled(path)  # checked per piece: a dropped upload stops promptly
            h.update(piece)
            yield piece

    staged = backend.stage(path, hashed(), size)
    return staged, Digest(size, h.hexdigest())


def publish(backend: Backend, rec: Record, staged: Staged, path: str) -> None:
    manifest.write(backend, rec)  # first: see manifest.py
    backend.publish(staged, path)


def copy(backend: Backend, rec: Record, src: str, dst: str) -> None:
    manifest.write(backend, rec)
    backend.copy(src, dst)


def carry(backend: Backend, rec: Record, src: str, dst: str, move: bool) -> None:
    manifest.write(backend, rec)
    if move:
        backend.move(src, dst)
    else:
        backend.copy(src, dst)


def delete(backend: Backend, path: str) -> None:
    backend.delete(path)
    manifest.delete(backend, path)


def fetch(backend: Backend, path: str) -> tuple[list[bytes], Digest]:
    h = manifest.hasher()
    blocks = []
    n = 0
    for b in backend.read(path):
        h.update(b)
        n += len(b)
        blocks.append(b)
    return blocks, Digest(n, h.hexdigest())


def scan(backend: Backend):
    return list(backend.walk()), manifest.read_all(backend)


# -- whole files, straight to and from the store --------------------------------
def write_file(backend: Backend, path: str, data: bytes | memoryview, mode: int = 0o644) -> Digest:
    """Publish `data` at `path` as the engine would: staged, recorded, then
    visible in one step (C2), checksummed (C6)."""
    view = memoryview(data).cast("B")
    pieces = (view[i : i + PIECE] for i in range(0, len(view), PIECE))
    staged, digest = stage(backend, pieces, len(view), path)
    try:
        old = manifest.read(backend, path)
        rec = Record(path, "file", digest, old.current if old is not None and old.kind == "file" else None, mode, time.time_ns())
        publish(backend, rec, staged, path)
    except BaseException:
        backend.discard(staged)
        raise
    return digest


def read_file(backend: Backend, path: str) -> bytes:
    """The bytes at `path`, verified against the manifest (IntegrityError if
    they do not match; files with no record are returned as they are)."""
    blocks, digest = fetch(backend, path)
    rec = manifest.read(backend, path)
    if rec is not None and rec.kind == "file" and rec.matches(digest.size, digest.xxh3) is None:
        raise IntegrityError(f"{path}: checksum mismatch: the store has {digest}, the manifest says {rec.current}")
    return b"".join(blocks)
