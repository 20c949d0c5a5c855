"""The write-back engine: persists what happens on the mount to the store.

See `ENGINE.md` beside this file for the state diagram and who owns what.
The engine is a few stages with one owner each, all on the trio thread:

- the journal intake (the `Journal` methods below, called by the inode tree
  as things happen): each seal and namespace change becomes an op, in order;
- upload workers: hash and stage sealed generations in parallel, in threads,
  from immutable snapshots (`_upload`); a large file written in order is
  staged while it is still being written (`streaming.py`);
- the publisher (`publisher.py`): applies ops strictly in order (C3);
- residency (`residency.py`): the RAM budget, eviction and loads.

Every store call goes through `calls.StoreCalls` (a deadline each, C11).
The engine knows nothing about FUSE; it sees the mount through `Namespace`.
Status, the control socket and metrics read it through `durability`,
`totals_of_queue` and the counters, never its internals.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import logging
import math
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import trio

from . import exchange, manifest, storeio, takeover
from .backend import HEARTBEAT_S, IMAGE, INDEX, Backend, Staged, StoreError
from .calls import Deadlines, StoreCalls, permanent
from .journal import LOST, Attrs, Exchange, FileGen, Link, Mkdir, Op, Remove, Rename, Snapshot, Symlink, kind
from .manifest import Digest, Meta, record_path
from .outside import Outside
from .publisher import MARKERS, Publisher
from .replica import Dir, File, Replica, Shown
from .replica import Link as RLink
from .residency import Counters, LoadTarget, Residency
from .state import State
from .streaming import Growing, Streams

if TYPE_CHECKING:
    from .following import Following

log = logging.getLogger(__name__)


class Node(Protocol):
    ino: int
    mode: int
    writers: int
    generation: int
    target: bytes  # symlinks


class ClusterLink(Protocol):
    """What the engine tells the other nodes of its cluster (cluster.events)."""

    publishes: bool  # this node's publisher applies the cluster's journal to the store

    def staged(self, gen: FileGen) -> None: ...  # a generation of this node's is staged: the publishing node shows it
    def published(self, gen: FileGen, path: str) -> None: ...  # the publishing node showed a generation
    def lost(self, gen: FileGen) -> None: ...  # the publishing node lost another node's generation with that node
    def restage(self, gen: FileGen) -> None: ...  # the staged data of another node's generation is gone: stage it again
    def held(self, gen: FileGen) -> None: ...  # the publishing node had a generation's turn and did not publish it (held, parked)
    def released(self, gen: FileGen) -> None: ...  # a generation is published or dropped
    async def leased(self) -> None: ...  # until this node may change the store (its lease to publish holds)
    reports_made: int  # the publishing node's progress reports, made
    reports_sent: int  # and the last of them that reached the other nodes
    async def reported(self) -> None: ...  # until a progress report made from now on reached the other nodes


class Restorer(Protocol):
    """Where a restart puts what the store holds (the mount's tree; see
    `fs.tree.InodeTree.restore`)."""

    def restore(self, path: str, mode: int, size: int = 0, mtime_ns: int | None = None, target: str = "", uid: int | None = None,
                gid: int | None = None) -> Node: ...  # one entry, as recorded
    def restore_files(self, parent: str, files: list[tuple[str, int, int, int, int | None, int | None]]) -> list[Node]: ...
    def inode_at(self, path: str) -> Node | None: ...


class Namespace(Restorer, Protocol):
    """The engine's view of the mount (implemented by fs.tree.InodeTree)."""

    def paths_of(self, ino: int) -> list[str]: ...
    def held_unnamed(self, ino: int) -> bool: ...  # no name left, open (or being opened): readable until its last close
    def directories(self) -> list[tuple[str, int]]: ...  # (path, inode) of each, parents first
    def symlinks(self) -> list[tuple[str, int, str]]: ...  # (path, inode, target) of each name
    def meta_of(self, ino: int) -> tuple[int, int, int, int] | None: ...  # (mode, uid, gid, mtime_ns)
    def evict(self, ino: int, generation: int) -> int: ...
    def begin_load(self, ino: int, spill: bool) -> LoadTarget | None: ...
    def begin_borrow(self, ino: int) -> LoadTarget | None: ...  # reads served from the store file in place
    def borrow_covers(self, ino: int, off: int, end: int | None) -> bool: ...
    def borrowed_fd(self, ino: int) -> int: ...  # the store file all of it is served from, verified (-1: none)
    def unborrow(self, ino: int) -> None: ...
    def let_go_held(self, ino: int) -> int: ...  # what a file read in place holds for its reader: bytes freed
    def free_bytes(self) -> int: ...
    def ram_for(self, size: int) -> int: ...  # what a file of `size` bytes takes of the budget, loaded into RAM
    def resident(self, ino: int) -> bool: ...
    def spilled(self, ino: int) -> bool: ...  # its bytes are in the spill directory, not RAM
    spill_dir: str | None
    def reseal(self, ino: int) -> bool: ...


@dataclass(frozen=True)
class Retry:
    first_s: float = 0.5
    max_s: float = 30.0
    failed_after: int = 3  # tries before a file is shown as FAILED (logged as ERROR)
    park_after: int = 3  # tries with a permanent error before a file is parked
    parked_s: float = 300.0  # how often parked files are tried again

    def delay(self, tries: int) -> float:
        return min(self.max_s, self.first_s * 2 ** min(max(0, tries - 1), 30))


DIR_SYNC_TRIES = 5  # tries in a row without progress before a flush leaves directory records to later
REMIND_S = 60.0  # a change still failing is logged again at most this often
THROUGHPUT_S = 30.0  # the upload rate status shows is over this long
IMAGE_EVERY = 1000  # record changes between saves of the manifest image (at least; see `_keep_image`)
IMAGE_CHECK_S = 5.0
IMAGE_RETRY_MAX_S = 300.0
STARTUP_TRIES = 6  # of a call the mount cannot start without (scan, claim): about 15 s of backoff
DISCARD_TRIES = 6  # of deleting staged data no file needs (transient failures; a later start removes what is left)


class Durability(NamedTuple):
    """What the engine knows of one file: the durability record status reads."""

    state: State  # of the newest sealed generation
    generation: int
    published_generation: int
    digest: Digest | None
    tries: int
    error: str
    sealed_at: float


class Left:
    """What a flush still waits for, of the ops it began with. They settle
    mostly in journal order, so each check trims settled ops off the front:
    a flush of n files costs O(n) over its life, not O(n) per change."""

    def __init__(self, engine: Engine, ops: list[Op]) -> None:
        self.e = engine
        self.ops = collections.deque(ops)

    def settled(self) -> bool:
        """Nothing left but what waits for a parked file (never by itself)."""
        while self.ops and not self.e.waiting(self.ops[0]):
            self.ops.popleft()
        if not self.ops or not self.e.stuck(self.ops[0]):
            return not self.ops
        return all(self.e.stuck(op) for op in self.now())

    def now(self) -> list[Op]:
        """The ops still waiting (a full pass: for progress reports)."""
        self.ops = collections.deque(op for op in self.ops if self.e.waiting(op))
        return list(self.ops)


class Engine:
    def __init__(self, backend: Backend, namespace: Namespace, *, workers: int = 4, retry: Retry = Retry(),
                 deadlines: Deadlines | None = None, markers: tuple[str, ...] = MARKERS) -> None:
        self.backend = backend
        self.ns = namespace
        self.retry = retry
        self.workers = workers
        self.calls = StoreCalls(deadlines or Deadlines())
        self.queue: collections.deque[Op] = collections.deque()
        self.pending: dict[int, FileGen] = {}  # the newest unsettled generation per inode
        # By seq, in order: what removals wait for. Settled ones leave from the
        # front (`Publisher.trim_settled`; an OrderedDict: O(1) at the front).
        self.unsettled: collections.OrderedDict[int, FileGen] = collections.OrderedDict()
        self.published_gen: dict[int, int] = {}
        self.publisher = Publisher(self, markers)
        self.residency = Residency(self)
        self.streams = Streams(self)
        self.counters: Counters = self.residency.counters
        self.skipped: dict[int, Op] = {}  # by seq: namespace changes the store could never take (flush and unmount report them)
        self.touched: set[int] = set()  # inodes whose generation changed state or left the in-flight set (for status)
        self._seq = 0
        self._send, self._recv = trio.open_memory_channel[FileGen](math.inf)
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (monotonic time, bytes published)
        # Every record as of the scan or the last save (manifest.Image, packed), and how many.
        self._image: bytes | None = None
        self._image_records = 0
        self._image_since: float | None = None
        self._taking = trio.Lock()
        self._leaving = False  # at the exit (`leave_index`): `_keep_image` saves no more
        self._timeless = False  # the store gives no times of change (no image saved then)
        self._outside: list[str] = []
        self.link: ClusterLink | None = None  # cluster mode (see `cluster`)
        self.gone: set[str] = set()  # cluster mode: nodes that died (their unstaged generations are lost)
        self.why_gone: dict[str, str] = {}
        self.stalled = ""  # cluster mode: why nothing is published for now (the publishing node is gone, a node takes over)
        self._sealed_elsewhere: dict[int, int] = {}  # cluster mode: inode -> the newest generation sealed elsewhere, applied here
        self._staged_early: dict[tuple[int, int], tuple[Staged, Digest]] = {}  # staged before its seal was applied here
        self._publishing = trio.CancelScope()  # the publisher's run (a node taking over publishing starts another)
        self.outside = Outside(self)  # files written straight to the store while this daemon did not answer

    def cluster(self, link: ClusterLink, publisher: Publisher) -> None:
        """Cluster mode: the journal is the whole cluster's (every node's
        seals and changes, in the cluster log's order); `publisher` applies
        it to the store on one node and follows that node's progress on the
        others (`Following`)."""
        self.link = link
        self.publisher = publisher

    # -- the Journal: called by the inode tree on the trio thread --------------
    def meta_of(self, ino: int) -> Meta | None:
        """An inode's mode, owner and mtime in the mount now."""
        found = self.ns.meta_of(ino)
        if found is None:
            return None
        mode, uid, gid, mtime_ns = found
        return Meta(stat.S_IMODE(mode), uid, gid, mtime_ns)

    def sealed(self, ino: int, generation: int, snapshot: Snapshot) -> None:
        meta = self.meta_of(ino)
        assert meta is not None
        gen = FileGen(self._next(), ino, generation, snapshot, meta, snapshot.size, self.ns.paths_of(ino), on_state=self._state_changed)
        self._enqueue(gen)
        if not self.streams.sealed(gen, snapshot):
            self._send.send_nowait(gen)

    def _state_changed(self, gen: FileGen) -> None:
        self.touched.add(gen.ino)

    def grew(self, ino: int, data: Growing) -> None:
        """A file open for writing was written on from where its writer got to (staged while written: streaming.py)."""
        self.streams.grew(ino, data)

    def sealed_elsewhere(self, ino: int, generation: int, size: int, owner: str) -> None:
        """Cluster mode: another daemon (`owner`) sealed this generation; its
        RAM holds the bytes and it stages them (`staged_elsewhere` when it has)."""
        meta = self.meta_of(ino)
        assert meta is not None
        gen = FileGen(self._next(), ino, generation, None, meta, size, self.ns.paths_of(ino), owner=owner, on_state=self._state_changed)
        gen.move(State.UPLOADING)
        self._enqueue(gen)
        self._sealed_elsewhere[ino] = generation
        early = self._staged_early.pop((ino, generation), None)
        if early is not None:  # its node staged it before this node applied its seal
            self.staged_elsewhere(ino, generation, *early)
        if self.published_gen.get(ino, 0) >= generation:  # published before this node applied its seal (staged or not)
            if gen.state is State.UPLOADING:
                gen.move(State.STAGED)
            self._settle(gen, gen.path)
        elif self.publisher.settled_before_join(gen.seq):  # replayed from before this node joined: long published...
            held = self.publisher.held_at_join(ino, generation)
            if held is not None:  # ...unless the publishing node holds or parked it: then it is unpublished here too
                self._held_there(gen, held)
                return
            gen.move(State.STAGED)
            gen.move(State.PUBLISHED)
            del self.pending[ino]
            self.published_gen[ino] = max(generation, self.published_gen.get(ino, 0))
            self.touched.add(ino)

    def adopt(self, sealed: dict[int, tuple[int, int, int]], position: int) -> None:
        """Cluster mode, a node joining late: its namespace is a snapshot at
        log `position` (`cluster.snapshot`), in which every op had its turn
        at the store: each file's last seal there (`sealed`: inode ->
        generation, size, mtime) is published, unless the publishing node
        holds or parked it (`held_at_join`)."""
        self.place(position)
        for ino, (generation, size, _) in sealed.items():
            held = self.publisher.held_at_join(ino, generation)
            if held is None:
                self.published_gen[ino] = generation
                continue
            meta = self.meta_of(ino)
            assert meta is not None  # in the snapshot: in the tree
            gen = FileGen(held[0], ino, generation, None, meta, size, self.ns.paths_of(ino), owner=held[1], on_state=self._state_changed)
            gen.move(State.UPLOADING)
            self.pending[ino] = gen
            self._sealed_elsewhere[ino] = generation
            self._held_there(gen, held)
        self.unsettled = collections.OrderedDict(sorted(self.unsettled.items()))

    def _held_there(self, gen: FileGen, held: tuple[int, str, str]) -> None:
        """`gen` had its turn at the publishing node before this node joined,
        which did not publish it: held (a completion marker waiting, a file
        renamed away) or parked (its error: lost with its node, or failed for
        good). It stays so here until that node says otherwise."""
        self.unsettled[gen.seq] = gen
        error = held[2]
        if error:
            gen.error, gen.error_at = error, time.time()
            gen.move(State.PARKED)
            self.publisher.park(gen)
        self.touched.add(gen.ino)  # else uploading, as any generation another node holds looks here

    def _enqueue(self, gen: FileGen) -> None:
        older = self.pending.get(gen.ino)
        if older is not None:
            older.superseded_by = gen
            self._drop(older, "superseded by a newer generation")
        self.residency.forget(gen.ino)
        self.pending[gen.ino] = gen
        self.unsettled[gen.seq] = gen
        self.queue.append(gen)
        self.notify()

    def place(self, position: int) -> None:
        """Cluster mode: the ops that follow come from this position of the
        cluster log. Their sequence numbers are made from it, so they are
        the same on every node (each node's journal is the same sequence)."""
        self._seq = max(self._seq, position << 8)

    def staged_elsewhere(self, ino: int, generation: int, staged: Staged, digest: Digest) -> None:
        """Cluster mode: the node that holds a generation staged it."""
        if generation > self._sealed_elsewhere.get(ino, 0):  # its seal is not applied here yet: it will be
            self._staged_early[(ino, generation)] = (staged, digest)
            return
        gen = self.pending.get(ino)
        if gen is None or gen.generation != generation or gen.owner is None or gen.state not in (State.UPLOADING, State.FAILED):
            # Heard again (a new publishing node asks for every staged file): kept. Else the
            # generation is gone here (superseded or deleted: reports travel apart from the log,
            # so its successor's seal may come first; lost), and nothing will show what it staged.
            again = gen is not None and gen.generation == generation and gen.staged is not None and gen.staged.token == staged.token
            if not again:
                self.discard_soon(staged, f"inode {ino} generation {generation}")
            return
        gen.staged, gen.digest = staged, digest
        gen.move(State.STAGED)
        self.notify()

    def lost(self, node: str, why: str) -> int:
        """Cluster mode: `node` is gone, and with its RAM every generation it
        had not staged yet. Each is parked, loudly, for good: the completion
        markers in its directory tree (and later removals) wait until its
        file is rewritten or deleted, as for any parked file. How many."""
        self.gone.add(node)
        self.why_gone[node] = why
        lost = [g for g in self.pending.values() if g.owner == node and g.state in (State.UPLOADING, State.FAILED)]
        for gen in lost:
            self._lose(gen)
        log.warning("%s: %d of its files lost (the files it staged are still published)", why, len(lost))
        self.notify()
        return len(lost)

    def back(self, node: str, name: str) -> None:
        """Cluster mode: `node`, taken for gone, beats again (it was frozen
        or cut off): what it writes from now on is published as any node's.
        What it held then stays lost (it hears so: `lost_here`)."""
        if node in self.gone:
            self.gone.discard(node)
            log.warning("node %s, taken for gone, is back: its files from before stay lost, its new ones are published", name)

    def lost_here(self, ino: int, generation: int, why: str) -> None:
        """Cluster mode: the publishing node lost this node's generation (it
        took this node for gone: frozen, or cut off from Redis)."""
        gen = self.pending.get(ino)
        if gen is None or gen.generation != generation or gen.owner is not None or gen.state in (State.PUBLISHED, State.DROPPED, State.PARKED):
            return
        if gen.staged is not None:
            staged, gen.staged = gen.staged, None
            self.discard_soon(staged, gen.path)
        self._lose(gen, why)
        self.notify()

    def _lose(self, gen: FileGen, why: str | None = None) -> None:
        why = why or self.why_gone[gen.owner or ""]
        gen.error, gen.error_at = f"{LOST}{why}", time.time()
        gen.move(State.PARKED)
        self.publisher.park(gen)
        self.touched.add(gen.ino)
        if self.link is not None and self.link.publishes and gen.owner is not None:
            self.link.lost(gen)  # its node hears it, if it is not gone for good (frozen, cut off)
        log.error("LOST %s (generation %d, %d bytes): %s; it was never published, and completion markers in its "
                  "directory wait until it is rewritten or deleted", gen.path, gen.generation, gen.size, why)

    def restage(self, ino: int, generation: int) -> None:
        """Cluster mode: the publishing node cannot show this node's
        generation from what it staged (gone, or an upload open at a name
        the file has left): stage it again, under a hidden key."""
        gen = self.pending.get(ino)
        if gen is not None and gen.generation == generation and gen.owner is None and gen.state is State.STAGED:
            gen.hidden = True  # publishable under any name: asked again perhaps because it moved from the one staged at
            gen.move(State.FAILED)
            self.upload_again(gen)

    def published_elsewhere(self, ino: int, generation: int, path: str, digest: Digest | None) -> None:
        """Cluster mode: the publishing node showed this generation at `path`
        (perhaps one this node took for lost: the publishing node died just
        after, and this node heard of its death first)."""
        self.publisher.showed(ino, generation, path, digest)
        gen = self.pending.get(ino)
        if gen is not None and gen.generation == generation:
            if gen.state is State.PARKED:
                gen.move(State.FAILED)
                self.publisher.parked.discard(gen)
            if gen.state in (State.UPLOADING, State.FAILED):
                gen.move(State.STAGED)
            if gen.state is State.STAGED:
                self._settle(gen, path)
        elif generation > self.published_gen.get(ino, 0):
            self.published_gen[ino] = generation
            self.notify()

    def renamed(self, src: str, dst: str, ino: int, is_dir: bool, replaced: int | None = None) -> None:
        op = Rename(self._next(), src, dst, ino, is_dir, replaced or 0)
        self._append(op)
        if replaced is not None:
            self._gone(replaced, op.seq)

    def exchanged(self, a: str, b: str) -> None:
        self._append(Exchange(self._next(), a, b))

    def linked(self, ino: int, path: str) -> None:
        self._append(Link(self._next(), path, ino))

    def removed(self, path: str, ino: int, is_dir: bool) -> None:
        op = Remove(self._next(), path, ino, is_dir)
        self._append(op)
        self._gone(ino, op.seq)

    def made_dir(self, path: str, ino: int) -> None:
        self._append(Mkdir(self._next(), path, ino))

    def made_symlink(self, path: str, ino: int, target: str) -> None:
        self._append(Symlink(self._next(), path, ino, target, self.meta_of(ino) or Meta(0o777)))

    def changed_attrs(self, ino: int) -> None:
        meta = self.meta_of(ino)
        if meta is None:
            return
        last = self.queue[-1] if self.queue else None
        if (self.link is None and isinstance(last, FileGen) and last.ino == ino and not last.publishing
                and last.state not in (State.PUBLISHED, State.DROPPED)):
            # Nothing changed in the mount between the file's seal and this
            # (tar and `cp -a` set a file's mode and times right after closing
            # it): the generation is published with them, as the mount has it
            # now. An op of its own after each file kept small files from being
            # published in groups.
            last.meta = meta
            return
        self._append(Attrs(self._next(), ino, meta))

    def _gone(self, ino: int, seq: int) -> None:
        """`ino` may have lost its last name at op `seq`: then its unpublished
        generation is never uploaded (C4)."""
        if self.ns.paths_of(ino):
            return
        self.streams.gone(ino)
        gen = self.pending.get(ino)
        if gen is not None:
            gen.dropped_by = seq
            self._drop(gen, "deleted before it was published")

    def freed(self, ino: int) -> None:
        """`ino` left the mount for good (no name, no open handle, no
        reference the kernel holds): what the engine kept to answer for it
        goes, so a mount that saves and rotates for weeks does not grow with
        every file it ever published. A generation of it still publishing
        (see `_drop`) is forgotten as it settles. (In a cluster its newest
        published generation stays: a node taking over rebuilds its replica
        of the store from what was published, of gone inodes too, whose
        removals it may have to apply; see `take_over`.)"""
        self.residency.freed(ino)
        if self.link is None:
            self.published_gen.pop(ino, None)

    # -- queries (status, control, metrics) -----------------------------------
    def durability(self, ino: int, digest: bool = True) -> Durability | None:
        """`digest=False`: without a published file's digest (a lookup in the replica)."""
        gen = self.pending.get(ino)
        published = self.published_gen.get(ino, 0)
        if gen is not None:  # a completion marker held back says why (`Publisher.held_back`)
            return Durability(gen.state, gen.generation, published, gen.digest, gen.tries, gen.error or self.publisher.held_back(gen),
                              gen.sealed_at)
        if published:
            shown = self.publisher_shown(ino) if digest else None
            return Durability(State.PUBLISHED, published, published, shown[1].digest if shown else None, 0, "", 0.0)
        return None

    def publisher_shown(self, ino: int) -> tuple[str, Shown] | None:
        return self.publisher.shown(ino)

    def unpublished(self) -> list[Op]:
        """What is not in the store yet: unsettled generations (held and
        parked ones included), queued renames and removals, waiting removals."""
        # An unsettled generation neither published nor dropped is not settled
        # (`Publisher.settled`): told from its state alone, as this walks
        # every file in flight at each `status` (100,000 of them: 0.1 s).
        published, dropped = State.PUBLISHED, State.DROPPED
        out: list[Op] = [g for g in self.unsettled.values() if g.state is not published and g.state is not dropped]
        # (a following node's queue keeps ops the publishing node applied beyond its position: done, see following.py)
        # Published generations still queued here: shown at one name, their
        # turn not over (`waiting`).
        leads = not self.publisher.follows
        out += [op for op in self.queue
                if (not isinstance(op, FileGen) or (leads and op.state is published)) and not op.done.is_set()]
        out += [op for _, op in self.publisher.deferred]
        return out + list(self.skipped.values())

    def failing(self, unpublished: list[Op] | None = None) -> list[Op]:
        """Unpublished ops (`unpublished()`, if the caller has it) whose
        last step failed (parked and skipped ones included), the newest
        error first. One that failed, then went on, is not failing any more."""
        ops = [op for op in (self.unpublished() if unpublished is None else unpublished)
               if op.error and (not isinstance(op, FileGen) or op.state in (State.FAILED, State.PARKED))]
        return sorted(ops, key=lambda op: op.error_at, reverse=True)

    def barrier(self, prefix: str = "") -> list[Op]:
        """What a flush of `prefix` ("" for everything) waits for: what is
        unpublished now and concerns it (at or under it, or a change of a
        directory above it: the store shows it there only once a move of
        one is applied), in journal order."""
        ops = sorted(self.unpublished(), key=lambda op: op.seq)
        if not prefix:
            return ops

        def under(path: str) -> bool:
            return path == prefix or path.startswith(prefix + "/")

        def concerns(path: str) -> bool:  # or a directory above it (moved, made: where its files go)
            return under(path) or prefix.startswith(path + "/")

        out: list[Op] = []
        for op in ops:
            if isinstance(op, FileGen):
                if any(under(p) for p in [*op.names, *self.ns.paths_of(op.ino)]):
                    out.append(op)
            elif isinstance(op, Rename | Exchange):
                if any(concerns(p) for p in ((op.src, op.dst) if isinstance(op, Rename) else (op.a, op.b))):
                    out.append(op)
            elif op.path and concerns(op.path):
                out.append(op)
        return out

    def waiting(self, op: Op) -> bool:
        """Not applied yet (a dropped generation needs nothing more; on the
        node that publishes, a published one whose turn has not ended is
        not applied yet: its turn shows it under its other names, its hard
        links, and after a takeover the gone node may have shown it at one
        name only; nor is one whose application sealed a file again, until
        that generation is)."""
        if op.resealed is not None and self.waiting(op.resealed):
            return True
        if isinstance(op, FileGen):
            if op.state is State.DROPPED:
                return False
            return not self.publisher.settled(op) or (not self.publisher.follows and not op.done.is_set())
        return not op.done.is_set() or op.seq in self.skipped  # skipped: never applied

    def stuck(self, op: Op) -> bool:
        """Cannot complete until a parked file is resolved (by a user), or
        never: a namespace change the store could not take (skipped)."""
        if op.resealed is not None and self.waiting(op.resealed):
            return self.stuck(op.resealed)
        if isinstance(op, FileGen):
            return op.state is State.PARKED or bool(self.publisher.held_back(op))
        return op.seq in self.skipped or (isinstance(op, Remove) and self.publisher.blocked_by_parked())

    async def wait_published(self, ino: int, generation: int) -> None:
        """Until `generation` of `ino` (or a newer one) is published; raises
        OSError(EIO) if it is parked (failed for good), a completion marker
        held back by what is (`Publisher.held_back`), or deleted."""
        while self.published_gen.get(ino, 0) < generation:
            gen = self.pending.get(ino)
            if gen is None:
                raise OSError(errno.EIO, "the file can no longer be published (deleted?)")
            if gen.state is State.PARKED:
                raise OSError(errno.EIO, f"publishing failed: {gen.error}")
            if why := self.publisher.held_back(gen):
                raise OSError(errno.EIO, f"not published: {why}")
            await self.wait_change()

    async def published_for_load(self, ino: int) -> None:
        """Cluster mode, before loading a file this node does not hold: until
        its newest generation is published, and (where another node
        publishes) until that node has applied everything this node's
        journal has for the file's path, so that the store shows it there."""
        gen = self.pending.get(ino)
        if gen is not None and gen.owner is not None:
            await self.wait_published(ino, gen.generation)
        paths = self.ns.paths_of(ino)
        # Following: also while this node takes over publishing, until its replica of the store is built (`take_over`)
        if self.publisher.follows and paths:
            left = Left(self, self.barrier(paths[0]))
            while not left.settled():
                await self.wait_change()

    async def flush(self) -> None:
        """A barrier: until everything queued before the call is applied
        (or stuck behind a parked file), directories' attributes included,
        and any step done again once a late try of it ended (`Publisher._do_again`)."""
        left = Left(self, self.barrier())
        while not left.settled() or self.publisher.doing_again():
            await self.wait_change()
        await self.sync_dirs()

    async def sync_dirs(self) -> None:
        """Record the directories' attributes as they are now (the publisher
        does it by itself only once the queue is quiet: a flush, and an
        unmount, must not leave them behind). Failures are tried again
        while tries make progress; a directory that fails `DIR_SYNC_TRIES`
        times in a row is left to the publisher's next sync, not waited
        for: one bad directory must not hold every flush."""
        tries, left = 0, math.inf
        while not await self.publisher.sync_dirs():
            tries = 1 if len(self.publisher.dirty) < left else tries + 1
            left = len(self.publisher.dirty)
            if tries > DIR_SYNC_TRIES:
                log.warning("the records of %d directories could not be written: tried again later", left)
                return
            await trio.sleep(self.retry.delay(tries))

    async def drain(self, timeout: float) -> list[Op]:
        """Publish everything queued within `timeout`; returns what is left."""
        with trio.move_on_after(timeout):
            await self.flush()  # the directories' final mtimes too, as they are at unmount
        return self.unpublished()

    async def wait_change(self) -> None:
        """Until anything in the engine changes state."""
        await self._wake.wait()

    def next_change(self) -> trio.Event:
        """The event the next change sets (to wait for after doing something else)."""
        return self._wake

    def throughput(self) -> float:
        """Bytes per second published over the last 30 s."""
        self._forget_before(time.monotonic() - THROUGHPUT_S)
        return sum(n for _, n in self._recent) / THROUGHPUT_S

    def _forget_before(self, t: float) -> None:
        """Publications before `t` no longer count (also as they happen: a
        mount nobody asks for its rate keeps no more than the last 30 s)."""
        while self._recent and self._recent[0][0] < t:
            self._recent.popleft()

    @property
    def verify_failures(self) -> dict[str, str]:
        return self.residency.verify_failures

    # -- running -------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for _ in range(self.workers):
                    nursery.start_soon(self._upload_worker, self._recv.clone())
                nursery.start_soon(self._publish)
                nursery.start_soon(self._heartbeat)
                nursery.start_soon(self._keep_image)
                task_status.started()
        finally:
            self.streams.stop_all()
            self._nursery = None  # stopped: background work (a load) runs in its caller instead

    async def _publish(self) -> None:
        while True:
            with trio.CancelScope() as self._publishing:
                await self.publisher.run()

    async def take_over(self) -> int:
        """Cluster mode: this node now publishes for the cluster; the node
        that did is gone. Its last progress said it had applied every op up
        to a position, but the removals it held back (or further: an
        exchange's plan in the store may say so). Its replica of the store
        is rebuilt (see `takeover`), those removals held back again, and a
        `Publisher` takes the place of this node's `Following` one. Returns
        the position it took over at."""
        assert self.link is not None
        following: Following = self.publisher  # type: ignore[assignment]
        position = max(following.leader_position, following.leader_applied)
        while True:
            try:
                scanned = await self.patiently("scan the store", storeio.scan, self.backend)
                # The index the gone node left at a clean exit is no longer
                # exact: this node changes records next.
                await self.patiently("take over publishing", self.backend.unindex)
                break
            except StoreError as exc:
                log.error("cannot take over publishing for the cluster yet: %s; trying again in %.0fs", exc, self.retry.max_s)
                await trio.sleep(self.retry.max_s)
        # Its image of the records is the scan's from now on (a node that followed keeps none).
        self._image, self._image_records, self._image_since = scanned.image.packed(), len(scanned.image.objects), scanned.image.since
        if self.backend.records_changed is not None:
            self.backend.records_changed.take()
        reported = position
        if scanned.exchanged > position:  # it applied an exchange after its last report, so everything before it too
            log.info("the gone node applied the journal up to position %d (an exchange), beyond the %d it reported",
                     scanned.exchanged, position)
            position = scanned.exchanged
        applied = list(itertools.takewhile(lambda op: op.seq <= position, self.queue))
        waiting = [op for op in applied if isinstance(op, Remove) and op.seq in following.waiting]
        # Removals it had their turn at after its last report: it may have held them back too, unreported.
        unsure = [op for op in applied if isinstance(op, Remove) and op.seq > reported]
        for op in applied:
            if op in waiting or op in unsure:
                self.queue.remove(op)  # held back again, or done below (its `done` stays unset until then)
            else:
                following._complete(op)
        publisher = Publisher(self, following.markers)
        ops = list(self.queue)  # everything after `position`
        def published(ino: int) -> tuple[int, Digest | None]:
            generation = self.published_gen.get(ino, 0)
            return generation, following.heard(ino, generation)

        symlinks = [(path, ino, target, self.meta_of(ino) or Meta()) for path, ino, target in self.ns.symlinks()]
        takeover.replicate(publisher, scanned, ops, lambda path: getattr(self.ns.inode_at(path), "ino", None), published,
                           self.ns.directories(), applied, waiting, unsure, symlinks)
        for op in [*waiting, *unsure]:
            if not any(o is op for _, o in publisher.deferred):  # nothing of it in the store
                op.done.set()
        if publisher.deferred:  # the removals it applied between those held again end their ranges
            again = {id(op) for _, op in publisher.deferred}
            first = publisher.deferred[0][1].seq
            publisher.not_held = [op.seq for op in applied if isinstance(op, Remove) and op.seq > first and id(op) not in again]
        held = [g for g in self.unsettled.values() if g.seq <= position and g.state not in (State.PUBLISHED, State.DROPPED)]
        then = takeover.names_then({g: self.ns.paths_of(g.ino) for g in held}, ops)
        for gen in held:
            gen.names = then[gen] or self.ns.paths_of(gen.ino)
            gen.done = trio.Event()  # completed above, as the gone node's; its turn again (`waiting`)
        publisher.position = position
        publisher.parked = {g for g in following.parked if g.state is State.PARKED}
        for gen in publisher.parked:
            if gen.owner is not None and gen.lost:
                self.link.lost(gen)  # lost while this node followed: their nodes hear it from the publishing node
        publisher.retry_parked_at = following.retry_parked_at
        self.queue.extendleft(reversed(held))  # their turn again, first
        log.info("took over publishing for the cluster at position %d: %d entries in the store, %d ops to apply, "
                 "%d generations and %d removals held again", position, len(scanned.entries), len(ops), len(held), len(publisher.deferred))
        self.publisher = publisher
        self._publishing.cancel()
        self.notify()
        return position

    def follow(self, following: Publisher) -> None:
        """Cluster mode: another node took over publishing from this one
        (frozen or cut off from Redis past its lease): `following` follows
        it from now on. This node's replica of the store goes: the other
        node rebuilt its own. Small files this node would have written
        whole at their turn are staged now, as every following node stages
        them; what is staged already, at a name or not, the other node
        publishes (`Events.follow` reports it)."""
        self.publisher = following
        self._publishing.cancel()
        for gen in list(self.pending.values()):  # left for this node's own publisher to write whole
            if gen.owner is None and gen.state is State.STAGED and gen.staged is not None and gen.staged.token is None:
                gen.move(State.FAILED)
                self.upload_again(gen)
        self.notify()

    async def _heartbeat(self) -> None:
        while True:
            await trio.sleep(HEARTBEAT_S)
            if not self.backend.daemon_id:
                continue  # not claimed the store (yet)
            try:
                await self.calls.run("heartbeat", self.backend.heartbeat)
            except Exception as exc:
                log.warning("cannot write this daemon's heartbeat to the store: %s", exc)

    async def _keep_image(self) -> None:
        """Save the manifest image (manifest.Image) once enough records
        changed since the last save, so that a restart after a crash reads
        only those changed since it: at most `IMAGE_EVERY`, or a quarter of
        all records if that is more (each save costs one pass over all of
        them). An image with no time yet (its scan read every record) is
        saved at once. Never on a store that gives no times of change: a
        restart reads every record there anyway. After a failed save the
        next waits longer, up to `IMAGE_RETRY_MAX_S` (a store down for long
        is not worth a warning every few seconds)."""
        wait = IMAGE_CHECK_S
        while True:
            await trio.sleep(wait)
            changed = self.backend.records_changed
            if not self.keeps_image or changed is None or self._timeless:
                continue
            if self._image_since is not None and len(changed) < max(IMAGE_EVERY, self._image_records // 4):
                continue
            try:
                await self.save_image(IMAGE, background=True)
                wait = IMAGE_CHECK_S
            except Exception as exc:  # the last one stands: a restart reads more records
                wait = min(2 * wait, IMAGE_RETRY_MAX_S)
                log.warning("cannot save the manifest image: %s; trying again in %.0fs", exc, wait)

    @property
    def keeps_image(self) -> bool:
        """Whether this daemon keeps an image of the manifest: from its scan
        on (or, in a cluster, from taking over publishing), while it is the
        one that publishes; a node that follows changes no record, and an
        image or index of the records it knew of would be stale."""
        return self._image is not None and not self.publisher.follows

    async def save_image(self, name: str, background: bool = False) -> None:
        """This daemon's image of every record, as of now, into object `name`
        (IMAGE or INDEX). The record changes noted before the image's time
        are taken from the backend here, on the trio thread, and given back
        if the save fails or is abandoned (then a late one written by the
        abandoned call is older than the next, and still right).
        `background` (`_keep_image`): none once the daemon is leaving."""
        async with self._taking:
            if background and self._leaving:
                return
            assert self._image is not None and self.backend.records_changed is not None
            since = await self.calls.run("save the manifest image", manifest.image_time, self.backend)
            changed = self.backend.records_changed.take()
            try:
                packed, records = await self.calls.run("save the manifest image", manifest.Image.saved, self.backend, self._image,
                                                       changed, since, name)
            except BaseException:
                self.backend.records_changed.give_back(changed)
                raise
            self._image, self._image_records, self._image_since = packed, records, since
            self._timeless = since is None
        log.info("%s (%d records)%s", "saved the manifest image" if name == IMAGE else "left the manifest index",
                 self._image_records, "" if since is not None else "; the store gives no times of change, so a restart after a crash reads every record")

    async def _upload_worker(self, recv: trio.MemoryReceiveChannel[FileGen]) -> None:
        async with recv:
            async for gen in recv:
                try:
                    await self._upload(gen)
                except Exception as exc:  # a bug must not take the mount (and its data) down
                    log.exception("write-back upload error for %s", gen.path)
                    try:
                        self.failed(gen, "upload", exc)
                    except Exception:
                        log.exception("cannot count the failed upload of %s", gen.path)

    async def _upload(self, gen: FileGen) -> None:
        if gen.state not in (State.DIRTY, State.FAILED) or gen.staged is not None:
            return
        if gen.size < self.backend.stage_ahead_from and (self.link is None or self.link.publishes):
            # Small: hashed here (microseconds), written whole at publication
            # with its group (a thread round trip each would cost far more).
            gen.move(State.UPLOADING)
            try:
                digest = manifest.digest_of(gen.pieces())
            except storeio.Cancelled:
                return
            except OSError as exc:  # a spilled file's bytes could not be read back
                self.failed(gen, "upload", exc)
                return
            gen.staged, gen.digest = Staged(gen.size, None), digest
            gen.move(State.STAGED)
            self.notify()
            return
        gen.move(State.UPLOADING)
        gen.attempt += 1
        attempt = gen.attempt
        self.notify()

        def cancelled() -> bool:  # read from the worker thread: a dropped or abandoned attempt stops
            return gen.state is State.DROPPED or gen.attempt != attempt

        try:
            names = [] if gen.hidden else self.ns.paths_of(gen.ino)  # where it will probably be published (the store may stage there)
            elsewhere = self.link is not None and not self.link.publishes  # by the cluster's publishing node, without the bytes
            staged, digest = await self.read_snapshot(gen, f"upload {gen.path}", storeio.stage, self.backend, gen.pieces(), gen.size,
                                                      cancelled, names[0] if names else None, elsewhere, nbytes=gen.size)
        except storeio.Cancelled:
            return
        except Exception as exc:
            if gen.state is State.UPLOADING and gen.attempt == attempt:
                gen.attempt += 1  # fence: a late finish of this attempt is discarded
                self.failed(gen, "upload", exc)
            return
        if gen.state is not State.UPLOADING or gen.attempt != attempt:  # dropped meanwhile
            self.discard_soon(staged, gen.path)
            return
        self.staged(gen, staged, digest)

    def staged(self, gen: FileGen, staged: Staged, digest: Digest) -> None:
        """This node staged `gen` (its upload worker, or its stream)."""
        if self.link is not None and not self.link.publishes and staged.token is None:
            # Left for this node's own publishing to write whole, which another node took over meanwhile (`follow`).
            gen.move(State.FAILED)
            self.upload_again(gen)
            return
        gen.staged, gen.digest = staged, digest
        gen.move(State.STAGED)
        if self.link is not None and not self.link.publishes:
            self.link.staged(gen)
        self.notify()

    async def read_snapshot(self, gens: FileGen | list[FileGen], what: str, fn: Callable, *args, nbytes: int = 0,
                            on_end: Callable[[], object] | None = None):
        """Run `fn` (which reads the snapshots of `gens`) in a thread with a
        deadline; the snapshots stay allocated until the thread is done, even
        if it is abandoned."""
        token = trio.lowlevel.current_trio_token()
        gens = gens if isinstance(gens, list) else [gens]
        for gen in gens:
            gen.readers += 1

        def body():
            try:
                return fn(*args)
            finally:
                with contextlib.suppress(trio.RunFinishedError):
                    token.run_sync_soon(self._readers_done, gens)  # without waiting for trio to run it

        return await self.calls.run(what, body, nbytes=nbytes, on_end=on_end)

    def _readers_done(self, gens: list[FileGen]) -> None:
        """Run by trio at a thread's request (`run_sync_soon`), once for all
        the snapshots the thread read (a group commit's 512: one wakeup of
        the event loop, not 512, each a write to its wakeup socket while
        FUSE requests wait). An exception here would end the whole run, so
        none leaves."""
        freed = False
        for gen in gens:
            gen.readers -= 1
            if gen.state in (State.PUBLISHED, State.DROPPED):
                try:
                    self._release(gen)
                except Exception:
                    log.exception("releasing the snapshot of %s failed", gen.path)
                freed = True
        if freed:
            self.notify()  # their memory may be free now

    def upload_again(self, gen: FileGen, delay: float = 0.0) -> None:
        gen.staged = None
        if gen.owner is not None:  # staged by another node
            if gen.state is State.STAGED:
                gen.move(State.FAILED)
            if gen.owner in self.gone:  # its staged copy went with its node: nothing can stage it again
                self._lose(gen)
            elif self.link is not None:
                self.link.restage(gen)
                if gen.state is State.FAILED:
                    gen.move(State.UPLOADING)  # by its node, again: shown as such, not as a failure
            return
        if delay <= 0 or self._nursery is None:
            self._send.send_nowait(gen)
            return

        async def later() -> None:
            await trio.sleep(delay)
            if gen.state in (State.FAILED, State.DIRTY):
                self._send.send_nowait(gen)

        self._nursery.start_soon(later)

    def failed(self, op: Op, step: str, exc: Exception) -> bool:
        """Count a failed step of `op`; True if that parked it, or gave up a
        dropped generation's take-back (`Publisher._take_back`: what a failed
        try of it left in the store stays there)."""
        if isinstance(op, FileGen) and op.state is State.PUBLISHED:
            return False
        dropped = isinstance(op, FileGen) and op.state is State.DROPPED
        if dropped:
            step = "take-back"
        if not dropped and isinstance(op, FileGen) and op.owner in self.gone and isinstance(exc, FileNotFoundError):
            self._lose(op)  # its staged copy went with its node (a new daemon cleared it): nothing can stage it again
            self.notify()
            return True
        op.tries += 1
        op.error, op.error_at = f"{step}: {type(exc).__name__}: {exc}", time.time()
        self.counters.retries += 1
        if op.tries == self.retry.failed_after:
            self.counters.failures += 1
        delay = self.retry.delay(op.tries)
        if dropped:
            if permanent(exc) and op.tries >= self.retry.park_after:
                log.error("take-back of %s failed for good (%s): what a failed try of it left in the store stays there", op.path, op.error)
                return True
        elif isinstance(op, FileGen):
            if permanent(exc) and op.tries >= self.retry.park_after:
                op.move(State.PARKED)
                self.publisher.park(op)
                log.error("%s of %s failed for good (%s): parked, retried every %.0fs; it blocks later removals and completion "
                          "markers in its directory tree until it is rewritten, deleted or published by a retry (markers: or moved out of "
                          "their tree)", step, op.path, op.error, self.retry.parked_s)
                self.notify()
                return True
            op.move(State.FAILED)
            op.retry_at = trio.current_time() + delay
            if step == "upload":
                self.upload_again(op, delay)
        elif permanent(exc) and op.tries >= self.retry.park_after:
            log.error("%s of %s cannot be applied to the store (%s): skipped; the store differs from the mount there",
                      kind(op), op.path, op.error)
            self.skipped[op.seq] = op
            self.notify()
            return True
        # WARNING per try at first, one ERROR when it counts as failed, then a
        # reminder a minute at most (an outage must not flood the log).
        now = time.monotonic()
        if op.tries < self.retry.failed_after or op.tries == self.retry.failed_after or now - op.logged_at >= REMIND_S:
            level = logging.ERROR if op.tries == self.retry.failed_after else logging.WARNING
            log.log(level, "%s of %s failed (try %d), retrying in %.1fs: %s", step, op.path or kind(op), op.tries, delay, op.error)
            op.logged_at = now
        self.notify()
        return False

    def published(self, gen: FileGen, path: str, lines: list[str] | None = None) -> None:
        """The publisher showed `gen` at `path`. Its log line goes to `lines`
        where given (the files one store call showed: `log_published` of
        them all after), else to the log now."""
        if gen.state is not State.PUBLISHED and self.link is not None and self.link.publishes:
            self.link.published(gen, path)
        self._settle(gen, path, lines)

    @staticmethod
    def log_published(lines: list[str]) -> None:
        """The lines of the files one store call published, as one log record
        (`EscapingFormatter` writes a line per file): a group of 512 small
        files costs the event loop one call to the log's handler, not 512,
        each a write to the log file during which FUSE requests wait."""
        if lines:
            log.info("%s", "\n".join(lines), extra={"lines": lines})

    def _settle(self, gen: FileGen, path: str, lines: list[str] | None = None) -> None:
        """`gen` is shown at `path` (by this node's publisher, or another's);
        `lines` as for `published`."""
        if gen.state is State.PUBLISHED:
            return
        gen.move(State.PUBLISHED)
        gen.shown_at = path
        self.touched.add(gen.ino)
        if self.pending.get(gen.ino) is gen:
            del self.pending[gen.ino]
        self.published_gen[gen.ino] = max(gen.generation, self.published_gen.get(gen.ino, 0))
        if self.link is not None:
            self.link.released(gen)
        self._release(gen)
        self.residency.published(gen.ino)
        if self.ns.meta_of(gen.ino) is None:  # freed while it published
            self.freed(gen.ino)
        self.counters.uploaded_bytes += gen.size
        self.counters.published_files += 1
        now = time.monotonic()
        self._recent.append((now, gen.size))
        self._forget_before(now - THROUGHPUT_S)
        since = time.time() - gen.sealed_at
        line = (f"published {path} ({gen.size} bytes, generation {gen.generation}, {since:.3f}s since seal, "
                f"{gen.size / max(since, 1e-6) / 1e6:.1f} MB/s)")
        if lines is None:
            log.info("%s", line)
        else:
            lines.append(line)
        self.notify()

    def superseded_in_store(self, gen: FileGen) -> None:
        """A newer file was written straight to the store over `gen`'s name."""
        self._drop(gen, "a newer file was written to the store directly")

    def publication_ended(self, gen: FileGen) -> None:
        """A publication under way ended without showing `gen` (its file
        left that name meanwhile, or its group's call failed): a deletion,
        or a newer generation, that `_drop` left alone while it was under way
        takes effect now (else it would stay unsettled for ever, and every
        removal and flush after it would wait)."""
        if gen.publishing:
            return
        if gen.superseded_by is not None:
            self._drop(gen, "superseded while its publication was under way")
        elif gen.dropped_by and not self.ns.paths_of(gen.ino):
            self._drop(gen, "deleted while its publication was under way")

    def _drop(self, gen: FileGen, why: str) -> None:
        if gen.state in (State.DROPPED, State.PUBLISHED) or gen.publishing:
            return  # a publication under way completes; what follows it is queued after
        gen.move(State.DROPPED)
        gen.attempt += 1
        self.touched.add(gen.ino)
        log.debug("dropping %s generation %d: %s", gen.path, gen.generation, why)
        if self.pending.get(gen.ino) is gen:
            del self.pending[gen.ino]
        self.publisher.parked.discard(gen)
        if gen.tried:
            self.publisher.taking_back.append(gen)
        if self.link is not None:
            self.link.released(gen)
        reported = self.link is not None and not self.link.publishes and gen.owner is None  # staged here: reported as soon as staged
        if gen.staged is not None and not reported:  # reported: the publishing node's to discard
            staged, gen.staged = gen.staged, None
            self.discard_soon(staged, gen.path)
        self._release(gen)
        self.notify()

    def discard_soon(self, staged: Staged, path: str) -> None:
        """Delete staged data (or abort its upload) in the background: it
        shows nothing, so there is no order to keep. Transient failures are
        tried again a few times (an upload left open costs storage until a
        restart); what is left then is removed at a later start
        (`Backend.prepare`)."""
        if self._nursery is not None:
            self._nursery.start_soon(self._discard, staged, path)

    async def _discard(self, staged: Staged, path: str) -> None:
        for tries in range(1, DISCARD_TRIES + 1):
            try:
                await self.calls.run(f"discard {path}", self.backend.discard, staged)
                return
            except Exception as exc:
                if permanent(exc) or tries == DISCARD_TRIES:
                    log.info("could not delete what was staged for %s (%s); a later start of the mount removes it", path, exc)
                    return
                await trio.sleep(self.retry.delay(tries))

    def _release(self, gen: FileGen) -> None:
        if gen.snapshot is not None and gen.readers == 0:
            gen.snapshot.release()
            gen.snapshot = None

    # -- residency (see residency.py) -----------------------------------------
    def evict(self, nbytes: int) -> int:
        return self.residency.evict(nbytes)

    def evict_file(self, ino: int) -> int:
        return self.residency.evict_file(ino)

    async def make_room(self, nbytes: int, patience_s: float = math.inf) -> bool:
        return await self.residency.make_room(nbytes, patience_s)

    async def make_spill_room(self) -> bool:
        return await self.residency.make_spill_room()

    def touch(self, ino: int) -> None:
        self.residency.touch(ino)

    async def load(self, ino: int, off: int = 0, end: int | None = None) -> None:
        await self.residency.load(ino, off, end)

    async def prefetch(self, prefix: str = "") -> tuple[int, list[tuple[str, str]]]:
        return await self.residency.prefetch(prefix)

    # -- restart -------------------------------------------------------------
    async def scan(self, into: Restorer | None = None) -> int:
        """Show what the store holds (C9) in `into` (the mount's namespace if
        None): namespace now, data on first read; modes, owners and mtimes as
        recorded (directories last, deepest first, so that restoring their
        entries does not change their mtimes). Returns how many files it shows."""
        ns = self.ns if into is None else into
        scanned = await self.patiently("scan the store", storeio.scan, self.backend)
        entries, records, bad = scanned.entries, scanned.records, set(scanned.unreadable)
        self._image, self._image_records, self._image_since = scanned.image.packed(), len(scanned.image.objects), scanned.image.since
        self._outside = scanned.outside
        self.residency.recheck = scanned.indexed
        replica = self.publisher.replica
        n = 0
        dirs_at: set[str] = set()  # every directory restored, and where the replica may have made one as a parent (`_bind_made`)
        # A listing gives each directory's entries together: files are
        # restored a directory at a time (its lookup done once).
        for (is_dir, parent), run in itertools.groupby(entries, key=lambda e: (e.is_dir, e.path.rpartition("/")[0])):
            dirs_at.add(parent)
            if is_dir:
                for e in run:
                    own = scanned.unrecorded.get(e.path, NOT_RECORDED_DIR)  # one with a record takes its attributes below
                    node = ns.restore(e.path, stat.S_IFDIR | own.mode, uid=own.uid, gid=own.gid)
                    self.publisher.restored(e.path, Dir(node.ino))
                    dirs_at.add(e.path)
                continue
            # Passes over the directory's files, around the tree's loop over
            # them: at 100,000 files, each step per file here counts.
            run = list(run)
            cut = len(parent) + 1 if parent else 0
            names = [e.path[cut:] for e in run]
            recs = [rec if rec is not None and rec.kind == "file" else None for rec in map(records.get, [e.path for e in run])]
            recorded = [NOT_RECORDED if rec is None else Meta(rec.mode, rec.uid, rec.gid, rec.mtime_ns) for rec in recs]
            given = list(map(_restorable, recorded))
            if scanned.unrecorded:  # files another tool put in the store: as its file system has them
                given = [scanned.unrecorded.get(e.path, meta) if rec is None else meta for e, rec, meta in zip(run, recs, given, strict=True)]
            nodes = ns.restore_files(parent, [(name, meta.mode, e.size, meta.mtime_ns, meta.uid, meta.gid)
                                              for name, e, meta in zip(names, run, given, strict=True)])
            inos = [node.ino for node in nodes]
            files = [(name, File(ino, shown=Shown(ino, 1, None if rec is None else rec.current, meta)))
                     for name, ino, rec, meta in zip(names, inos, recs, recorded, strict=True)]
            self.residency.expect(inos, recs)
            for ino, rec, e in zip(inos, recs, run, strict=True):
                if rec is None and record_path(e.path) in bad:
                    self.residency.unverifiable(ino, e.path)
            self.published_gen.update(dict.fromkeys(inos, 1))
            self.publisher.restored_files(parent, files)
            n += len(files)
        for rec in records.values():
            if rec.kind == "symlink":
                node = ns.restore(rec.path, stat.S_IFLNK | 0o777, 0, rec.mtime_ns, rec.target, rec.uid, rec.gid)
                self.publisher.restored(rec.path, RLink(node.ino, target=rec.target, shown=True, meta=rec.meta))
                dirs_at.add(rec.path.rpartition("/")[0])
        dirs = [rec for rec in records.values() if rec.kind == "dir"]
        for rec in sorted(dirs, key=lambda r: -(r.path.count("/") + bool(r.path))):
            meta = _restorable(rec.meta)
            node = ns.restore(rec.path, stat.S_IFDIR | meta.mode, 0, meta.mtime_ns, "", meta.uid, meta.gid)
            d = replica.lookup(rec.path)
            if not isinstance(d, Dir):
                d = Dir(node.ino)
                self.publisher.restored(rec.path, d)
            d.recorded = rec.meta
            dirs_at.add(rec.path)
        # A directory the store has no record of comes back with the time of
        # this restart: recorded at the next sync, the next restart shows it so.
        self.publisher.dirty.update(d for d in _bind_made(replica, ns, dirs_at) if d.recorded is None)
        return n

    async def claim(self, daemon_id: str, started: float) -> None:
        """Become the store's writer (`Backend.prepare`): after the scan."""
        sole = self.link is None or self.link.publishes  # a node joining a running cluster: others stage too

        def claim() -> None:
            self.backend.prepare(daemon_id, started, sole)
            if sole:  # the scan finished the last exchange's plan; the journal positions it names are not this journal's
                exchange.forget(self.backend)

        await self.patiently("claim the store", claim)
        for mark in self._outside:  # the scan read every record: what they warned of is known
            await self.patiently("claim the store", self.backend.delete, mark)

    async def leave_index(self) -> None:
        """At a clean exit: leave every record in one object for the next
        mount (manifest.Image): the index, exact, if this daemon knows them
        all (everything published, no abandoned call that may still change
        one, no record changed meanwhile without a daemon); otherwise a
        manifest image, which the next mount checks against the store's times."""
        if not self.keeps_image:
            return
        # An image save under way ends first, and none starts after: the daemon
        # retires next, and its staging (the image staged there) goes with it.
        self._leaving = True
        async with self._taking:
            pass
        # Nothing left that would change a record next: no generation or op
        # to publish, no directory to sync (the publisher syncs them by
        # itself when its queue is quiet), no record call under way.
        changes = self.backend.records_changed
        exact = (not self.unpublished() and not self.calls.stragglers() and not self.publisher.dirty
                 and not (changes is not None and changes.under_way()))
        try:
            if exact and not await self.calls.run("leave the manifest index", self.backend.find, manifest.OUTSIDE):
                # Not while an image is being saved (`_keep_image` runs until
                # the exit): that save has taken the record changes noted
                # since the last one, and they are not in `_image` yet.
                async with self._taking:
                    if not self.backend.records_changed and (self._image_since is not None or self._timeless):  # as it was found
                        await self.calls.run("leave the manifest index", self.backend.put, INDEX, self._image)
                        return
                await self.save_image(INDEX)
            elif self.backend.records_changed:
                await self.save_image(IMAGE)
        except Exception as exc:  # the next mount reads more records instead
            log.warning("cannot leave the manifest index in the store (%s): the next mount reads the records changed since "
                        "the last image", exc)

    async def patiently(self, what: str, fn, *args):
        """A store call the mount cannot start without. A store can be slow
        to answer its first requests (a server just started, a cold cache):
        transient failures are retried with backoff a few times; then, or on
        a permanent failure, `StoreError` says why the mount cannot start."""
        tries = 0
        while True:
            try:
                return await self.calls.run(what, fn, *args)
            except StoreError:
                raise  # the store is not one to mount: it says why
            except Exception as exc:
                tries += 1
                if permanent(exc) or tries >= STARTUP_TRIES:
                    raise StoreError(f"{what} failed{f' {tries} times' if tries > 1 else ''}: {exc}") from exc
                delay = self.retry.delay(tries)
                log.warning("%s failed (try %d of %d), retrying in %.1fs: %s", what, tries, STARTUP_TRIES, delay, exc)
                await trio.sleep(delay)

    # -- internals -------------------------------------------------------------
    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _append(self, op: Op) -> None:
        self.queue.append(op)
        self.notify()

    def notify(self) -> None:
        self._wake.set()
        self._wake = trio.Event()


def _bind_made(replica: Replica, ns: Restorer, paths: set[str]) -> list[Dir]:
    """Bind the directories the replica made as parents while a restart
    restored what is under them (`Replica.directory`: no inode) to the
    mount's directories there. An object store lists no directory that
    holds no file, and records are restored deepest first: a directory
    left with no inode is never recorded again (`Publisher.sync_dirs`
    skips it), so its changes after the restart would be lost at the next.
    `paths` and their ancestors are looked at; returns those directories
    (the root aside)."""
    seen: set[str] = set()
    found: list[Dir] = []
    for path in paths:
        while path and path not in seen:
            seen.add(path)
            d = replica.lookup(path)
            if isinstance(d, Dir):
                if not d.ino:
                    node = ns.inode_at(path)
                    if node is not None:
                        replica.rebind_ino(d, node.ino)
                found.append(d)
            path = path.rpartition("/")[0]
    return found


NOT_RECORDED = Meta()  # a file the store holds with no record (and keeps no attributes of: `storeio.unrecorded_meta`)
NOT_RECORDED_DIR = Meta(0o755)  # the same, a directory


def _restorable(meta: Meta) -> Meta:
    """Set-ID bits come back only together with their owner: an entry whose
    record has no owner (older records) is the mount owner's, and must never
    become set-user-ID to them."""
    if meta.uid is None or meta.gid is None:
        return Meta(meta.mode & ~(stat.S_ISUID | stat.S_ISGID), None, None, meta.mtime_ns)
    return meta
