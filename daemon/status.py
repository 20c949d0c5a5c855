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

from ckptfs.fs.ops import XATTR_PREFIX
from ckptfs.fs.tree import Inode, InodeTree
from ckptfs.writeback.journal import FileGen
from ckptfs.writeback.state import State

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


def file_status(tree: InodeTree, engine: Engine, inode: Inode, path: str) -> FileStatus:
    assert inode.data is not None
    d = engine.durability(inode.ino)
    digest = None
    tries, error = 0, ""
    if inode.version != inode.sealed_version or d is None:
        state = "dirty"
    elif d.generation == inode.generation:
        state = "failed" if d.state is State.PARKED else d.state.value
        digest, tries, error = d.digest, d.tries, d.error
        if d.state is State.PARKED:
            error = f"parked (failed for good, retried rarely): {error}"
    elif d.published_generation >= inode.generation:
        state = State.PUBLISHED.value
    else:
        state = "dirty"
    data = inode.data
    return FileStatus(inode.ino, path, inode.size, state, inode.generation, digest.xxh3 if digest else "", tries, error,
                      data.resident, data.spilled, inode.writers > 0)


XATTRS = ("state", "xxh3", "generation", "error")


def xattr(tree: InodeTree, engine: Engine, inode: Inode, name: bytes) -> bytes:
    """`user.ckptfs.<field>` of a regular file; OSError(ENODATA) if none."""
    field_name = name.removeprefix(XATTR_PREFIX).decode(errors="replace")
    paths = tree.paths_of(inode.ino)
    if not inode.is_reg or inode.data is None or field_name not in XATTRS or not paths:
        raise OSError(errno.ENODATA, "no such attribute")
    value = str(getattr(file_status(tree, engine, inode, paths[0]), field_name))
    if not value:
        raise OSError(errno.ENODATA, "not known yet")
    return value.encode()


def files(tree: InodeTree, engine: Engine, prefix: str = "") -> list[FileStatus]:
    """Every regular file (under `prefix`), by path."""
    out = []
    for inode in list(tree.inodes.values()):
        if not inode.is_reg or inode.data is None:
            continue
        for path in tree.paths_of(inode.ino):
            if not prefix or path == prefix or path.startswith(prefix + "/"):
                out.append(file_status(tree, engine, inode, path))
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


def totals(tree: InodeTree, engine: Engine) -> Totals:
    t = Totals()
    seen: set[int] = set()
    for f in files(tree, engine):
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
    usage = tree.usage()
    t.budget_limit, t.budget_used = usage.limit, usage.used
    left = engine.unpublished()
    t.queue = len(left)
    sealed = [g.sealed_at for g in left if isinstance(g, FileGen)]
    t.oldest_unpublished_s = time.time() - min(sealed) if sealed else 0.0
    t.upload_bytes_per_s = engine.throughput()
    t.last_error = engine.last_error
    t.counters = {**asdict(engine.counters), "verify_failures": len(engine.verify_failures)}
    return t
