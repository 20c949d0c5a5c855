"""What is durable yet: one file's state, and the totals for a mount.

The single place that combines the mount's view (sizes, unsealed changes,
what is in RAM) with the engine's (each generation's write-back state), so
`ckptfs status`, the `user.ckptfs.*` extended attributes and the Prometheus
metrics all report the same thing. Runs on the trio thread; no FUSE here.
"""

from __future__ import annotations

import errno
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from ckptfs.writeback.state import State

from .store import Inode, InodeStore

if TYPE_CHECKING:
    from ckptfs.writeback.engine import Engine

# The states a file is shown in (a file, not a generation: "dirty" also
# covers changes not sealed yet, e.g. a file still open for writing).
STATES = ("dirty", "uploading", "staged", "failed", "published")


@dataclass(frozen=True)
class FileStatus:
    ino: int
    path: str
    size: int
    state: str  # one of STATES
    generation: int
    xxh3: str  # "" until known
    tries: int
    error: str
    resident: bool  # bytes in RAM (or in the spill file), not only in the store
    spilled: bool
    open_for_write: bool


def file_status(store: InodeStore, engine: Engine, inode: Inode, path: str) -> FileStatus:
    assert inode.data is not None
    gen = engine.pending.get(inode.ino)
    digest = None
    tries, error = 0, ""
    if inode.version != inode.sealed_version:
        state = "dirty"
    elif gen is not None and gen.generation == inode.generation:
        state = gen.state.value
        digest, tries, error = gen.digest, gen.tries, gen.error
    elif engine.published_gen.get(inode.ino, 0) >= inode.generation:
        state = State.PUBLISHED.value
        digest = engine.published_digest(inode.ino, path)
    else:
        state = "dirty"
    data = inode.data
    return FileStatus(inode.ino, path, inode.size, state, inode.generation, digest.xxh3 if digest else "", tries, error,
                      data.resident, data.spilled, inode.writers > 0)


XATTR_PREFIX = b"user.ckptfs."
XATTRS = ("state", "xxh3", "generation", "error")


def xattr(store: InodeStore, engine: Engine, inode: Inode, name: bytes) -> bytes:
    """`user.ckptfs.<field>` of a regular file; OSError(ENODATA) if none."""
    field_name = name.removeprefix(XATTR_PREFIX).decode(errors="replace")
    paths = store.paths_of(inode.ino)
    if not inode.is_reg or inode.data is None or field_name not in XATTRS or not paths:
        raise OSError(errno.ENODATA, "no such attribute")
    value = str(getattr(file_status(store, engine, inode, paths[0]), field_name))
    if not value:
        raise OSError(errno.ENODATA, "not known yet")
    return value.encode()


def files(store: InodeStore, engine: Engine, prefix: str = "") -> list[FileStatus]:
    """Every regular file (under `prefix`), by path."""
    out = []
    for inode in list(store.inodes.values()):
        if not inode.is_reg or inode.data is None:
            continue
        for path in store.paths_of(inode.ino):
            if not prefix or path == prefix or path.startswith(prefix + "/"):
                out.append(file_status(store, engine, inode, path))
    out.sort(key=lambda f: f.path)
    return out


@dataclass
class Count:
    files: int = 0
    bytes: int = 0

    def add(self, size: int) -> None:
        self.files += 1
        self.bytes += size


@dataclass
class Totals:
    files: Count = field(default_factory=Count)
    by_state: dict[str, Count] = field(default_factory=lambda: {s: Count() for s in STATES})
    in_ram: Count = field(default_factory=Count)
    spilled: Count = field(default_factory=Count)
    evicted: Count = field(default_factory=Count)
    budget_limit: int = 0
    budget_used: int = 0
    queue: int = 0
    oldest_unpublished_s: float = 0.0
    upload_bytes_per_s: float = 0.0
    last_error: str = ""
    counters: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["budget_free"] = max(0, self.budget_limit - self.budget_used)
        return d


def totals(store: InodeStore, engine: Engine) -> Totals:
    t = Totals()
    seen: set[int] = set()
    for f in files(store, engine):
        if f.ino in seen:  # hard links: the file once
            continue
        seen.add(f.ino)
        t.files.add(f.size)
        t.by_state[f.state].add(f.size)
        if not f.resident:
            t.evicted.add(f.size)
        elif f.spilled:
            t.spilled.add(f.size)
        else:
            t.in_ram.add(f.size)
    usage = store.usage()
    t.budget_limit, t.budget_used = usage.limit, usage.used
    t.queue = len(engine.queue)
    sealed = [g.sealed_at for g in engine.unpublished()]
    t.oldest_unpublished_s = time.time() - min(sealed) if sealed else 0.0
    t.upload_bytes_per_s = engine.throughput()
    t.last_error = engine.last_error
    t.counters = {**asdict(engine.counters), "verify_failures": len(engine.verify_failures)}
    return t
