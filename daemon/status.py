"""What is durable yet: one file's state, and the totals for a mount.

The single place that combines the mount's view (sizes, unsealed changes,
what is in RAM) with the engine's (each generation's write-back state), so
`ckptfs status`, the `user.ckptfs.*` extended attributes and the Prometheus
metrics all report the same thing. Runs on the trio thread; no FUSE here.
"""

from __future__ import annotations

import collections
import errno
import itertools
import operator
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import trio
from ckptfs.fs.ops import XATTR_PREFIX
from ckptfs.fs.tree import Inode, InodeTree
from ckptfs.writeback.journal import LOST, FileGen
from ckptfs.writeback.state import State

if TYPE_CHECKING:
    from ckptfs.writeback.engine import Durability, Engine

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
    state = _state(inode, d)
    digest, tries, error = None, 0, ""
    if d is not None and inode.version == inode.sealed_version and d.generation == inode.generation:
        digest, tries, error = d.digest, d.tries, d.error
        if d.state is State.PARKED and not error.startswith(LOST):  # lost with its node (cluster mode): never retried
            error = f"parked (failed for good, retried rarely): {error}"
    data = inode.data
    return FileStatus(inode.ino, path, inode.size, state, inode.generation, digest.xxh3 if digest else "", tries, error,
                      data.resident, data.spilled, inode.writers > 0)


def _state(inode: Inode, d: Durability | None) -> str:
    """One of STATES: the file's, from the engine's record of it."""
    if inode.version != inode.sealed_version or d is None:
        return "dirty"
    if d.generation == inode.generation:
        return "failed" if d.state is State.PARKED else _SHOWN[d.state]
    return "published" if d.published_generation >= inode.generation else "dirty"


_SEALED_AT = operator.attrgetter("sealed_at")
_SHOWN = {s: s.value for s in State}  # (`.value` of an enum member is a descriptor call: a restart asks for it once a file)


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


FILES_BATCH = 1000  # files looked at between two turns of the event loop (about 7 ms of work)


async def files(tree: InodeTree, engine: Engine, prefix: str = "") -> list[FileStatus]:
    """Every regular file (under `prefix`), by path: the cost of the
    subtree. The mount keeps serving while a long listing is made: the
    walk gives the event loop a turn every FILES_BATCH files (100,000 files
    took 0.7 s here, every request to the mount waiting). So it is not one
    instant's view: a file removed meanwhile is left out, one renamed
    meanwhile may show at its old name, its new one, both or neither."""
    out = []
    for n, (path, inode) in enumerate(tree.files_under(prefix), 1):
        if inode.links:  # not removed while the walk waited
            out.append(file_status(tree, engine, inode, path))
        if n % FILES_BATCH == 0:
            await trio.sleep(0)
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
    failing: int = 0  # unpublished changes whose last try failed
    lost: int = 0  # cluster mode: files lost with the node that held them
    stalled: str = ""  # cluster mode: why publishing is paused now ("" while it goes on)
    last_error: str = ""  # the newest of their errors ("" when nothing fails)
    last_error_age_s: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["budget_free"] = max(0, self.budget_limit - self.budget_used)
        return d


def recount(tree: InodeTree, engine: Engine) -> Totals:
    """The totals counted from every file: O(files). The reference `Ledger`
    is checked against; the daemon answers from the ledger."""
    t = Totals()
    seen: set[int] = set()
    entries = []
    for path, inode in tree.files_under():
        if inode.ino in seen:  # hard links: the file once
            continue
        seen.add(inode.ino)
        entries.append(_entry(file_status(tree, engine, inode, path)))
    _count_all(t, entries, +1)
    return _finish(t, tree, engine)


def _entry(f: FileStatus) -> tuple[str, int, str]:
    return f.state, f.size, _where(f.resident, f.spilled)


def _where(resident: bool, spilled: bool) -> str:
    return "evicted" if not resident else "spilled" if spilled else "in_ram"


def _ledger_entry(engine: Engine, inode: Inode) -> tuple[str, int, str]:
    """`_entry(file_status(...))` without what the totals do not count (the
    path, the digest): a restart refreshes one per file in the store."""
    assert inode.data is not None
    return _state(inode, engine.durability(inode.ino, digest=False)), inode.size, _where(inode.data.resident, inode.data.spilled)


def _count_all(t: Totals, entries: list[tuple[str, int, str]], sign: int) -> None:
    """Add (sign 1) or take away (-1) these entries. Alike entries (a
    restart's files: published, evicted, mostly of few sizes) are counted
    together, in C: one by one, they were a fifth of the catch-up after a
    restart over 100,000 files (0.24 s of the event loop; 0.18 s now)."""
    for (state, size, where), n in collections.Counter(entries).items():
        for c in (t.files, t.by_state[state], getattr(t, where)):
            c.files += sign * n
            c.bytes += sign * n * size


KEEP_UP_BATCH = 2000
# A file made or published costs a refresh about 4 us: 10,000 made in the 5 s
# this was cost a `status` asked right after them 37 ms of the event loop.
KEEP_UP_EVERY_S = 1.0


class Ledger:
    """The totals, kept current by what changed: the inode tree records the
    files it touched, the engine those whose generation changed state or
    left the in-flight set; a query refreshes those, so it costs
    O(changes), not O(files) nor O(files in flight) (`recount` is the
    O(files) reference)."""

    def __init__(self, tree: InodeTree, engine: Engine) -> None:
        self.tree, self.engine = tree, engine
        self.entries: dict[int, tuple[str, int, str]] = {}
        self.sums = Totals()
        self.backlog: set[int] = set()  # touched, not refreshed yet (a batch at a time)

    def refresh(self, limit: int | None = None) -> bool:
        """Bring the sums up to date; with `limit`, for at most that many
        files (True: some are left for the next call). Each batch costs
        O(batch + new changes): what one leaves waits in the backlog, never
        copied again (a restart's 100,000 files, 2,000 a batch, were copied
        whole at every batch)."""
        backlog = self.backlog
        for changed in (self.tree.touched, self.engine.touched):
            if len(changed) > len(backlog):
                backlog, changed = changed, backlog
            backlog |= changed
        self.tree.touched, self.engine.touched = set(), set()
        if limit is None or len(backlog) <= limit:
            touched, self.backlog = backlog, set()
        else:
            touched, self.backlog = {backlog.pop() for _ in range(limit)}, backlog
        left = bool(self.backlog)
        entries, inodes, engine = self.entries, self.tree.inodes, self.engine
        old = [e for e in map(entries.pop, touched, itertools.repeat(None)) if e is not None]
        new = []
        for ino in touched:  # a generation's change of state touches its file (`FileGen.on_state`)
            inode = inodes.get(ino)
            if inode is None or not inode.is_reg or inode.data is None or not inode.links:  # gone, or unlinked: no path
                continue
            entry = entries[ino] = _ledger_entry(engine, inode)
            new.append(entry)
        _count_all(self.sums, old, -1)
        _count_all(self.sums, new, +1)
        return left

    def totals(self) -> Totals:
        self.refresh()
        t = Totals()
        for name in ("files", "in_ram", "spilled", "evicted"):
            c = getattr(self.sums, name)
            setattr(t, name, Count(c.files, c.bytes))
        t.by_state = {k: Count(c.files, c.bytes) for k, c in self.sums.by_state.items()}
        return _finish(t, self.tree, self.engine)

    async def caught_up(self) -> None:
        """Refresh a batch at a time, the event loop getting a turn between
        batches: after a restart over 100,000 files, all of them are to be
        counted (0.2 s at once), and the mount keeps serving meanwhile."""
        while self.refresh(limit=KEEP_UP_BATCH):
            await trio.sleep(0)

    async def keep_up(self, every_s: float = KEEP_UP_EVERY_S) -> None:
        """Refresh now (a restart's files), then every `every_s`, so what the
        tree and engine record between queries stays small however long
        nobody asks, and a query refreshes at most that long's changes."""
        while True:
            await self.caught_up()
            await trio.sleep(every_s)


def _finish(t: Totals, tree: InodeTree, engine: Engine) -> Totals:
    usage = tree.usage()
    t.budget_limit, t.budget_used = usage.limit, usage.used
    left = engine.unpublished()
    t.queue = len(left)
    gens = [g for g in left if isinstance(g, FileGen)]
    t.oldest_unpublished_s = time.time() - min(map(_SEALED_AT, gens)) if gens else 0.0
    t.upload_bytes_per_s = engine.throughput()
    t.stalled = engine.stalled
    failing = engine.failing(left)  # not a second pass over the queue (0.07 s with 100,000 files in it)
    t.failing = len(failing)
    t.lost = sum(1 for g in failing if isinstance(g, FileGen) and g.lost)  # lost: parked with an error, so failing
    if failing:
        t.last_error, t.last_error_age_s = failing[0].error, max(0.0, time.time() - failing[0].error_at)
    t.counters = {**asdict(engine.counters), "verify_failures": len(engine.verify_failures)}
    return t
