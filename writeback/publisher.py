"""The publisher: applies the journal to the store, strictly in order (C3).

It replays each op on the `Replica` (the store's namespace at the journal
position reached) and makes the store agree:

- A sealed generation's turn: it is bound to the names it had when sealed.
  Under each name the live mount still gives it, it is published (record
  first, then the data, made visible in one step). Under a name the file no
  longer has, it is *held*: not visible (C4), kept staged, and shown when a
  later rename or link gives it a live name (or dropped with its file).
- A rename moves what the store shows, in the store, at its turn. A directory
  becomes visible as a unit: on a local store its held members are put in
  place and the directory moves with one rename(2); on an object store
  members move first and completion markers (`markers`) last.
- Removals wait (see `_gated`): a removal is applied only at a journal
  position where everything sealed before it is in the store or was gone
  from the mount by then (deleted or replaced before its turn, C4), and so
  is everything sealed before that; so rotation never removes an old
  checkpoint before a newer one is in the store, even when the newer ones
  were themselves deleted before their turn.
- A generation that fails permanently (a name the store cannot take) is
  *parked* after `Retry.park_after` tries: loud, retried rarely, and it no
  longer blocks the queue. It still blocks later removals and completion
  markers in its directory tree, so nothing vouches for it or replaces it.

Every store call goes through `StoreCalls` (deadlines, C11). Publication is
idempotent: after any crash or abandoned call, doing it again is correct.
"""

from __future__ import annotations

import bisect
import collections
import errno
import fnmatch
import functools
import itertools
import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from . import exchange, manifest, storeio
from .backend import META
from .calls import StoreTimeout
from .heldback import HeldBack
from .journal import Attrs, Exchange, FileGen, Link, Mkdir, Named, Op, Remove, Rename, Symlink, kind
from .manifest import Digest, Record
from .replica import Dir, File, Node, Replica, Shown
from .replica import Link as RLink
from .state import State
from .unreported import Unreported

if TYPE_CHECKING:
    from .backend import Staged
    from .engine import Engine

log = logging.getLogger(__name__)

# Files that vouch for others: shown last when a directory moves on an object
# store, and held back while a file in their directory tree is parked.
MARKERS = ("commit_success.txt", ".metadata", "ckptfs-commit.json", "latest", "latest_*", "*.latest", "latest_checkpointed_iteration.txt")


@dataclass
class _Late:
    """A store step abandoned at its deadline whose thread may still land."""

    at: tuple[str, ...]
    ops: tuple[Op | None, ...]  # whose step it was (a group: every generation in it)
    what: str
    ended: trio.Event
    showing: bool  # a publication (`Publisher.call`)
    step: object  # the call it is a try of: its retries go ahead of it (`Publisher.call`)
    # The step as a later try of it did it, while this one still ran: done
    # once more when this one ends (`Publisher._do_again`), before anything
    # else changes those paths.
    again: Callable[[], Awaitable[object]] | None = None


def _stage_snapshot(backend, gen: FileGen, name: str) -> tuple[Staged, Digest]:
    """Stage `gen`'s sealed bytes, read from its snapshot anew: each try of
    a step retried in place (`Publisher.call`) needs its own reader (the one
    a failed try read to its end gives the next nothing)."""
    return storeio.stage(backend, gen.pieces(), gen.size, None, name)


def _overlap(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Whether two sets of store paths share a path, or one holds the other."""
    return any(x == y or x.startswith(y + "/") or y.startswith(x + "/") for x in a for y in b)


def _paths(op: Op) -> tuple[str, ...]:
    """The names `op` changes."""
    if isinstance(op, Rename):
        return op.src, op.dst
    if isinstance(op, Exchange):
        return op.a, op.b
    if isinstance(op, FileGen):
        return tuple(op.names)
    return (op.name,) if isinstance(op, Named) else ()


class Stale(Exception):
    """A step retried after a failure is no longer wanted (see `call`)."""


class GiveUp(Exception):
    """The op being applied failed for good (parked or skipped, logged)."""


GROUP_MAX = 512  # generations shown by one group commit
RECORDS_PER_CALL = 1000  # records a directory rename writes or deletes in one store call
RECORD_NBYTES = 4096  # what one record costs a store call's deadline (as if it moved this many bytes)
DIR_SYNC_QUIET_S = 0.2  # directory records are written after the queue has been empty this long


class Publisher:
    follows = False  # a cluster node's `Following`: another node applies the journal to the store

    def __init__(self, engine: Engine, markers: tuple[str, ...] = MARKERS) -> None:
        self.e = engine
        self.replica = Replica()
        self.markers = markers
        self.position = 0  # seq of the last op applied (or deferred)
        self.deferred: collections.deque[tuple[Node | None, Remove]] = collections.deque()
        # Where the store may stand, from the generations settled so far (`_gated`):
        # the furthest journal position the store lacks one of them from, and
        # the last position before which each of them is in the store or gone.
        self._reach = 0
        self._cut = 0
        # Removals after the first of `deferred` that had their turn and are not held back, ascending (`removals_held`)
        self.not_held: list[int] = []
        self._removals_held: tuple[object, HeldBack] | None = None  # the last `removals_held`, while neither list changed
        self.parked: set[FileGen] = set()
        self.taking_back: collections.deque[FileGen] = collections.deque()  # dropped where a failed try may have shown them (`_take_back`)
        self.late: list[_Late] = []  # abandoned steps not finished yet
        self.waiting_markers: set[File] = set()  # held: they would vouch for a file the store does not show yet
        self.unreported = Unreported()  # cluster mode: what changed since the progress last reached the other nodes
        self.retry_parked_at = 0.0
        self.current: Op | None = None  # the op being applied: store steps count their failures on it
        # A directory being moved: (its path, where its members' bytes are
        # now, and which members: by id, or None for all). Copies for hard
        # links take them from there (`_now_at`).
        self.relocated: tuple[str, str, set[int] | None] | None = None
        self.single_until = 0  # seq up to which ops go one at a time (a group of them failed)
        # Directories whose mode, owner or mtime may differ from their record:
        # recorded when the queue is idle (metadata is not ordered data).
        self.dirty: set[Dir] = set()
        # Held while an op is applied, and while directory records are
        # written (a flush writes them from its own task): a record written
        # beside an op under way could land at a name the op just moved or
        # removed, and bring back at a restart a directory the mount no longer has.
        self.changing = trio.Lock()

    # -- store steps -------------------------------------------------------------
    async def call(self, what: str, fn, *args, nbytes: int = 0, reading: FileGen | None = None, at: tuple[str, ...] = (),
                   still: Callable[[], bool] | None = None, showing: bool = False, step: object | None = None):
        """One store step of the op being applied, retried in place until it
        succeeds, so an op of many steps makes progress through transient
        errors instead of starting over (every step is idempotent). A
        permanent failure, after `Retry.park_after` tries, parks the
        generation or skips the op: `GiveUp`.

        `at`: the store paths the step changes. A step abandoned at its
        deadline may still land late; until its thread is done, no other
        step changes those paths, so a late step can never undo a later one
        (C11): not a later op's, nor a later step of the same op (a
        directory's move after the publication of a file into it), nor what
        takes back a try of it. Its own retries may (they do the same thing:
        tries of one call of this, `step`; not another call of the same
        name, which may write other attributes into the same record), and so
        may a publication of the same op after an abandoned one (`showing`:
        the files of a group whose call hung, one at a time).

        `still`: checked before each retry; False ends the step with `Stale`
        (what it would do is no longer wanted: the file left that name while
        the store was failing, and C4 wants it shown under its new name only)."""
        attempt = 0
        step = object() if step is None else step
        while True:
            if attempt and still is not None and not still():
                raise Stale(what)
            try:
                return await self._fenced(what, fn, *args, nbytes=nbytes, reading=reading, at=at, showing=showing, step=step)
            except storeio.NewerInStore:
                raise
            except Exception as exc:
                if isinstance(exc, storeio.StagingLost) and isinstance(reading, FileGen) and reading.owner is None:
                    raise  # staged again from its snapshot (`_materialize`); another node's is that node's to stage
                op = self.current
                if op is None:
                    raise
                if self.e.failed(op, "publish", exc):
                    raise GiveUp from exc
                attempt += 1  # the backoff follows this step's failures in a row, not the op's total
                await trio.sleep(self.e.retry.delay(attempt))

    async def _after_late_steps(self, at: tuple[str, ...], showing: bool, step: object) -> None:
        """Wait while an abandoned step may still change `at` (see `call`),
        and do again what one that ended late may have undone."""
        while True:
            self.late = [x for x in self.late if not x.ended.is_set() or x.again is not None]
            late = next((x for x in self.late if _overlap(x.at, at) and not (
                x.step is step or (x.showing and showing and any(op is self.current for op in x.ops)))), None)
            if late is None:
                return
            if late.ended.is_set():
                await self._do_again(late)
                continue
            log.warning("waiting for the abandoned store call %s to finish before changing %s again", late.what, ", ".join(at))
            await late.ended.wait()

    async def _do_again(self, late: _Late) -> None:
        """The step of `late` once more, as a step of its op (its failures
        counted on it): `late` was abandoned, a later try of the step
        succeeded, and `late` ended after it. Each try's calls are
        idempotent, not the two tries' calls interleaved: what `late` did
        last may undo part of the later try (a deletion marks its record,
        deletes the file, then the record; its first call landing after the
        retry deleted the record, and the next one failing, left a record
        with no file: `verify` called the deleted file missing)."""
        log.info("the abandoned store call %s ended after a later try of it succeeded: done once more", late.what)
        was, self.current = self.current, late.ops[0]
        try:
            await late.again()
        except GiveUp:
            pass  # logged
        finally:
            self.current = was
        late.again = None
        self.e.notify()  # a flush waits for it

    def _to_do_again(self) -> _Late | None:
        """An abandoned try that ended, whose step is to be done again now (`_do_again`)."""
        return next((x for x in self.late if x.ended.is_set() and x.again is not None), None)

    def doing_again(self) -> bool:
        return self._to_do_again() is not None

    async def _fenced(self, what: str, fn, *args, nbytes: int = 0, reading: FileGen | list[FileGen] | None = None, at: tuple[str, ...] = (),
                      showing: bool = False, step: object | None = None):
        """One try of a store step that changes `at`: after any abandoned step
        on those paths is done (but those `call` lets go ahead), and recorded
        as late if this one is abandoned in turn (a group's step: late for
        each generation in it)."""
        step = object() if step is None else step  # (one try, on its own: no retry of it goes ahead of it)
        await self._after_late_steps(at, showing, step)
        self.e.residency.disturb(at)
        link, op = self.e.link, self.current
        if link is not None:
            await link.leased()
            if op is not None and at and self.unreported.conflicts(at, op, link.reports_sent):
                log.debug("%s: waiting until this node's progress reached the other nodes (see unreported.py)", what)
                await link.reported()
                self.unreported.clear()
        late = _Late(at, tuple(reading) if isinstance(reading, list) else (op,), what, trio.Event(), showing, step)  # if abandoned

        def on_end() -> None:
            late.ended.set()
            if late.again is not None:
                self.e.notify()  # its step is to be done again (`_step`)

        try:
            if reading is not None:
                out = await self.e.read_snapshot(reading, what, fn, *args, nbytes=nbytes, on_end=on_end)
            else:
                out = await self.e.calls.run(what, fn, *args, nbytes=nbytes, on_end=on_end)
        except StoreTimeout:
            if at:
                self.late.append(late)
            raise
        finally:  # failed or not: it may have changed the store
            if link is not None and op is not None:
                self.unreported.note(at, op, link.reports_made, link.reports_sent)
        if op is not None and reading is None:  # (a publication's late try lands the same bytes: nothing to undo)
            for x in self.late:
                if x.step is step and not x.ended.is_set():
                    x.again = functools.partial(self.call, what, fn, *args, nbytes=nbytes, at=at, showing=showing, step=step)
        return out

    # -- the loop --------------------------------------------------------------
    async def run(self) -> None:
        e = self.e
        while True:
            try:
                async with self.changing:
                    idle = await self._step()
                if idle:
                    await self._idle()
            except trio.Cancelled:
                raise
            except Exception as exc:  # a bug: logged, and the op is tried again at the head of the queue
                log.exception("write-back publisher error")
                op = e.queue[0] if e.queue else None
                if op is not None and self.e.failed(op, "publish", exc):
                    self._complete(op)
                    continue
                await trio.sleep(e.retry.delay(op.tries if op else 1))
            finally:
                self.current = None

    async def _step(self) -> bool:
        """Apply the op at the head of the queue (or a group of ops); True
        if there is nothing to do until something changes."""
        e = self.e
        while (late := self._to_do_again()) is not None:
            await self._do_again(late)
        await self._release_deferred()
        while self.taking_back:
            gen = self.current = self.taking_back[0]  # its failures count on it (`Engine.failed`)
            try:
                await self._take_back(gen)
            except GiveUp:
                pass  # logged
            finally:
                self.current = None
            self.taking_back.popleft()
        if self.parked and trio.current_time() >= self.retry_parked_at:
            await self._retry_parked()
        await self._show_waiting_markers()  # also after a step that returned early (`_remove_group`)
        if not e.queue:
            return True
        op = self.current = e.queue[0]
        if isinstance(op, FileGen) and await self._publish_group():
            return False
        if isinstance(op, Remove) and await self._remove_group():
            return False
        try:
            if isinstance(op, FileGen):
                if not await self._turn(op):
                    return self.e.link is None or not await self._publish_group(around=True)
            else:
                await self._apply(op)
        except GiveUp:
            pass  # parked or skipped, loudly: it no longer blocks the queue
        self._complete(op)
        self._dirty_after(op)
        await self._show_waiting_markers()
        return False

    async def _idle(self) -> None:
        change = self.e.next_change()  # taken first: a change while directories sync must not be missed
        if self.dirty and not self.e.queue:
            # Only once the queue has been quiet a moment: a burst of saves is
            # not slowed by records of directories it is still changing.
            with trio.move_on_after(DIR_SYNC_QUIET_S):
                await change.wait()
            if change.is_set():
                return
            await self.sync_dirs()
        deadline = self.retry_parked_at if self.parked else float("inf")
        if self.dirty:  # a sync failed: try again later, or at the next change
            deadline = min(deadline, trio.current_time() + self.e.retry.max_s)
        with trio.move_on_at(deadline):
            await change.wait()

    # -- directory records --------------------------------------------------------
    def _dirty_after(self, op: Op) -> None:
        """The directories `op` changed (entries added or removed: their
        mtimes; an Attrs op on a directory: itself)."""
        if isinstance(op, FileGen):
            paths = op.names
        elif isinstance(op, Rename):
            paths = [op.src, op.dst]
        elif isinstance(op, Exchange):
            paths = [op.a, op.b]
        elif isinstance(op, Attrs):
            if op.ino == self.replica.root.ino:  # (the replica's index of inodes never holds the root)
                self.dirty.add(self.replica.root)
            self.dirty.update(n for _, n in self.replica.nodes_of(op.ino) if isinstance(n, Dir))
            return
        else:
            paths = [op.path]
        for path in paths:
            parent = self.replica.lookup(path.rpartition("/")[0])
            if isinstance(parent, Dir):
                self.dirty.add(parent)
        if isinstance(op, Mkdir | Rename):
            moved = self.replica.lookup(op.name if isinstance(op, Mkdir) else op.dst)
            if isinstance(moved, Dir):
                self.dirty.add(moved)
                self.dirty.update(n for _, n in self.replica.walk(moved) if isinstance(n, Dir))

    async def sync_dirs(self) -> bool:
        """Write the record of every dirty directory whose attributes in the
        mount differ from it (and, on a local store, give the store's
        directory the mount's mode). A failure leaves that directory dirty,
        for later, and the others are written all the same. True if none
        failed."""
        failed = set()
        async with self.changing:
            try:
                for d in sorted(self.dirty, key=lambda n: -len(self.replica.path_of(n) or "")):
                    self.dirty.discard(d)  # first: a change while its record is written makes it dirty again
                    path = self.replica.path_of(d)
                    meta = self.e.meta_of(d.ino)
                    if path is None or meta is None or meta == d.recorded:
                        continue
                    try:
                        # The mode first: a record written, and then a failed chmod, left
                        # the directory taken for unrecorded, and its record behind at its
                        # path when it was removed or moved (a restart showed it again).
                        if d.made and path:
                            await self._fenced(f"chmod {path}", self.e.backend.chmod, path, meta.mode & 0o1777, at=(path,))
                        d.unsure = True  # until the write returns
                        await self._fenced(f"record {path or '/'}", manifest.write, self.e.backend, Record.of(path, "dir", meta), at=(path,))
                    except Exception as exc:
                        log.warning("cannot record the attributes of directory %s yet: %s", path or "/", exc)
                        failed.add(d)
                        continue
                    except BaseException:  # cancelled halfway (an unmount's end): still to do
                        failed.add(d)
                        raise
                    d.recorded, d.unsure = meta, False
            finally:
                self.dirty |= failed
        return not failed

    async def _attrs(self, op: Attrs) -> None:
        for path, node in self.replica.nodes_of(op.ino):
            if isinstance(node, File) and node.held is not None and node.held.ino == op.ino:
                # Its turn passed unshown (renamed away): shown later, so as the file is by then
                node.held.meta = op.meta
            if isinstance(node, File) and node.shown is not None and node.shown.meta != op.meta:
                rec = Record.of(path, "file", op.meta, current=node.shown.digest)
                await self.call(f"record {path}", manifest.write, self.e.backend, rec, at=(path,))
                if node.shown.meta.mode != op.meta.mode:
                    await self.call(f"chmod {path}", self.e.backend.chmod, path, op.meta.mode & 0o777, at=(path,))
                node.shown.meta = op.meta
            elif isinstance(node, RLink):
                node.meta = op.meta
                if node.shown:
                    await self.call(f"record {path}", manifest.write, self.e.backend, Record.of(path, "symlink", op.meta, target=node.target), at=(path,))

    def _complete(self, op: Op) -> None:
        link = self.e.link
        deferred = isinstance(op, Remove) and any(o is op for _, o in self.deferred)
        if link is not None and link.publishes:
            if isinstance(op, FileGen) and op.state not in (State.PUBLISHED, State.DROPPED):
                link.held(op)  # nodes joining later hear it is not published (`Following.held_at_join`)
            if not deferred:  # what it changed in the replica, if not in the store (nothing shown there)
                self.unreported.note(_paths(op), op, link.reports_made, link.reports_sent)
        if self.e.queue[0] is op:
            self.e.queue.popleft()
            self.position = op.seq
        else:  # published ahead of its turn (cluster mode, see `_group`): the position stays
            self.e.queue.remove(op)
        self.trim_settled()
        if not deferred:
            op.done.set()
        self.e.notify()

    # -- a sealed generation's turn ------------------------------------------
    async def _turn(self, gen: FileGen) -> bool:
        """False: not ready yet (staging), wait."""
        if gen.state is State.DROPPED:
            return True
        if gen.state is State.PARKED:
            self._hold(gen, gen.names)
            return True
        names = gen.names
        if gen.state is State.PUBLISHED and self.shown(gen.ino) is not None:
            # Shown ahead of its turn (cluster mode), at its one name; or by the
            # node that published before this one, which died in its turn:
            # its other names (hard links) may still show older bytes, and
            # are shown again, copied from the name it said it showed. (No
            # such name: published before this node joined, its turn long over.)
            names = [name for name in gen.names if name != gen.shown_at] if gen.shown_at else []
            if not names:
                return True
        if gen.staged is None and gen.state is not State.PUBLISHED:
            return False  # still uploading, or its upload failed and is scheduled again
        if gen.retry_at > trio.current_time():
            await trio.sleep_until(gen.retry_at)
            return False
        log.debug("turn of %s generation %d (seq %d) as %s", gen.path, gen.generation, gen.seq, names)
        await self._clear_way(names)
        for name, node in self._hold(gen, names):
            await self._materialize(name, node)
        return True

    # -- group commit ----------------------------------------------------------
    def _group(self, around: bool = False) -> list[FileGen]:
        """The plain generations at the head of the queue: staged, one live
        name each, not a completion marker, nothing else to do there (no
        waiting removal, no other name showing the file, no failed try).
        Among themselves they are unordered data (C3 orders markers, renames
        and removals after them), so they can be shown in any order.

        `around` (cluster mode, the head not ready): the plain generations
        among the files at the head that may go before it: data files of
        other nodes publish in parallel, so one node's file still staging
        does not hold back another node's. What comes after a generation
        that waits, from its node or at its name, waits too, and so does
        every completion marker and whatever follows a namespace change."""
        group: list[FileGen] = []
        names: set[str] = set()
        waiting_nodes: set[str | None] = set()
        waiting_names: set[str] = set()
        now = trio.current_time()
        for op in self.e.queue:
            if len(group) == GROUP_MAX or not isinstance(op, FileGen):
                break
            if around and op.state in (State.DROPPED, State.PARKED):
                continue  # its turn only completes it (or holds it): nothing to wait for
            if around and (op.owner in waiting_nodes or waiting_names.intersection(op.names)):
                waiting_nodes.add(op.owner)
                waiting_names.update(op.names)
                continue
            ready = (op.state is State.STAGED and not op.tries and op.staged is not None and op.retry_at <= now
                     and len(op.names) == 1)
            name = op.names[0] if ready else ""
            if (not ready or name in names or self._is_marker(name) or not self._plain_spot(name, op.ino)
                    or not self.live_at(name, op.ino) or (op.owner is not None and op.staged.at not in (None, name))):
                if not around:
                    break
                waiting_nodes.add(op.owner)
                waiting_names.update(op.names)
                continue
            group.append(op)
            names.add(name)
        return group

    def _plain_spot(self, path: str, ino: int) -> bool:
        """Whether the replica has directories (or nothing) above `path`, and
        at it nothing or a file showing `ino` or another inode, with nothing
        held, no other name of `ino`, and no waiting removal or late call."""
        if any(_overlap((path,), (self.replica.path_of(n) or "",)) for n, _ in self.deferred if n is not None):
            return False
        if any(_overlap((path,), late.at) for late in self.late):
            return False
        node: Node | None = self.replica.root
        for part in path.split("/")[:-1]:
            node = node.children.get(part) if isinstance(node, Dir) else None
            if node is None:
                break
            if not isinstance(node, Dir):
                return False
        at = self.replica.lookup(path)
        if at is not None and (not isinstance(at, File) or at.held is not None):
            return False
        return all(n is at for _, n in self.replica.nodes_of(ino))

    async def _publish_group(self, around: bool = False) -> bool:
        """Show a group of plain generations with one store call: records,
        then data, made durable together (local stores: two syncfs for the
        group instead of three fsyncs per file). False if there is no group
        or the call failed: the head of the queue then goes the usual way,
        one op at a time, retried in place (publication is idempotent).
        `around`: the generations that may go before the head (see `_group`)."""
        if self.e.queue[0].seq <= self.single_until:
            return False
        group = self._group(around)
        if len(group) < (1 if around else 2):
            return False
        held = [(gen, *self._hold(gen, gen.names)[0]) for gen in group]
        items = [(self._record(name, gen, node), gen.staged, name, gen.pieces) for gen, name, node in held]
        if not await self._in_one_call(f"publish {len(group)} files", items, [gen for gen, _, _ in held]):
            # Its files go one at a time (each retried in place, a permanent
            # failure parked): a failing group is never tried again whole.
            self.single_until = group[-1].seq
            return False
        lines: list[str] = []
        try:
            for gen, name, node in held:
                _shown(node, gen)
                self._made_parents(name)
                self.e.published(gen, name, lines)
                self._complete(gen)
                self._dirty_after(gen)
        finally:
            self.e.log_published(lines)
        await self._show_waiting_markers()
        return True

    async def _in_one_call(self, what: str, items: list[tuple[Record, Staged, str, Callable[[], Iterable]]], gens: list[FileGen],
                           recorded: bool = True) -> bool:
        """Publish a group of generations with one store call
        (`storeio.publish_group`; `gens`: each item's); False if it failed
        (logged: each item may have landed all the same, `_take_back`)."""
        for gen in gens:
            gen.publishing = True
        try:
            await self._fenced(what, storeio.publish_group, self.e.backend, items, recorded, nbytes=sum(g.size for g in gens), reading=gens,
                               at=tuple(path for _, _, path, _ in items), showing=True)
        except Exception as exc:
            log.debug("%s: not done together (%s): one at a time", what, exc)
            for gen, (_, _, path, _) in zip(gens, items, strict=True):
                gen.tried.add(path)
            for gen in dict.fromkeys(gens):
                gen.publishing = False
                self.e.publication_ended(gen)
            return False
        finally:
            for gen in gens:
                gen.publishing = False
        return True

    def _hold(self, gen: FileGen, names: list[str]) -> list[tuple[str, File]]:
        """Bind `gen` to `names` in the replica, held there until shown."""
        nodes = []
        for name in names:
            node = self.replica.lookup(name)
            if not isinstance(node, File):
                node = File(gen.ino)
                self.replica.bind(name, node)
            elif node.ino != gen.ino:
                self.replica.rebind_ino(node, gen.ino)
            node.held = gen
            nodes.append((name, node))
        return nodes

    async def _symlink(self, name: str, node: RLink) -> None:
        """A symlink made at `name`: its record, if the live mount still has it there (C4)."""
        replaced = self.replica.bind(name, node)
        if self.live_at(name, node.ino):
            await self.call(f"record {name}", manifest.write, self.e.backend, Record.of(name, "symlink", node.meta, target=node.target), at=(name,))
            node.shown = True
        elif isinstance(replaced, RLink) and replaced.shown:
            # Applied again by a node taking over: the record the gone node wrote stays until the removal that follows
            node.shown = True

    def _symlink_of(self, ino: int) -> RLink | None:
        """A name the replica gives symlink `ino`, if it is one."""
        return next((n for _, n in self.replica.nodes_of(ino) if isinstance(n, RLink)), None)

    def live_at(self, path: str, ino: int) -> bool:
        node = self.e.ns.inode_at(path)
        return node is not None and node.ino == ino

    async def _materialize(self, path: str, node: File, into: str | None = None) -> bool:
        """Show `node`'s held generation at `path` if the live mount has it
        there (at `into` instead: assembling a directory). True if shown."""
        gen = node.held
        if gen is None:  # nothing to publish; a hard link whose Link's turn found it elsewhere is copied now
            return into is None and await self._show_copy(path, node)
        if gen.state is State.DROPPED or gen.ino != node.ino:
            node.held = None
            return False
        if gen.state is State.PARKED or not self.live_at(path, gen.ino):
            if gen.state is not State.PARKED:
                await self._take_back(gen, into or path)
            return False
        if self._marker_blocked(path) or self._vouches_for_held(path, gen):
            log.debug("%s waits: a file in its directory tree is not in the store yet", path)
            self.waiting_markers.add(node)
            return False
        at = into or path
        if (gen.owner is not None and gen.state is not State.PUBLISHED and self._shown_source(gen, exclude=node) is None
                and (gen.staged is None or gen.staged.at not in (None, at))):
            # another node's, and what it staged cannot be shown here: it stages the file again
            return await self._staged_again(gen, path) and await self._materialize(path, node, into)
        # The record names where the bytes land; none inside a hidden assembly
        # directory (the directory move writes the records for the final paths).
        rec = None if at.startswith(META + "/") else self._record(at, gen, node)
        source = self._shown_source(gen, exclude=node)
        if gen.staged is not None and source is None and gen.state is not State.PUBLISHED:
            gen.publishing = True
            try:
                staged = gen.staged
                # The bytes again: for stores that PUT small files at publication, or upload again
                # what was staged at another name (S3).
                await self.call(f"publish {at}", storeio.publish, self.e.backend, rec, staged, at, gen.digest,
                                gen.pieces, gen.meta.mode, nbytes=gen.size, reading=gen, at=(at,), still=lambda: self.live_at(path, gen.ino),
                                showing=True)
            except Stale:
                gen.publishing = False
                gen.tried.add(at)  # (Stale comes only after a failed try)
                try:
                    await self._take_back(gen, at)
                finally:
                    if gen.state is State.FAILED:
                        gen.move(State.STAGED)  # held under the name it left, shown at its rename's turn
                    self.e.publication_ended(gen)
                return False
            except storeio.NewerInStore as newer:
                gen.publishing = False
                there = newer.record
                log.warning("%s: the store holds a newer file, written there directly after this generation was sealed "
                            "(the torch helpers' fallback): keeping it, not publishing generation %d over it", path, gen.generation)
                node.shown = Shown(0, 0, there.current, there.meta)
                node.held = None
                self.e.superseded_in_store(gen)
                return False
            except GiveUp:
                gen.tried.add(at)
                raise
            except storeio.StagingLost as lost:  # this node's own generation (see `call`)
                gen.publishing = False
                log.warning("%s: %s: staging generation %d again from its snapshot", path, lost.strerror, gen.generation)
                staged, digest = await self.call(f"stage {at} again", _stage_snapshot, self.e.backend, gen, at,
                                                 nbytes=gen.size, reading=gen, at=(at,), showing=True)
                if digest != gen.digest:  # never: a snapshot does not change
                    raise OSError(errno.EIO, f"{at}: its snapshot read back as {digest}, sealed as {gen.digest}") from lost
                gen.staged = staged
                return await self._materialize(path, node, into)
            finally:
                gen.publishing = False
            if staged.token is not None:
                gen.staged = None  # consumed: the staging object is now the file
        elif source is not None:
            await self.call(f"copy {source} to {at}", storeio.show, self.e.backend, rec, source, at, False, nbytes=gen.size, at=(at,))
        elif gen.state is State.PUBLISHED:
            # Shown under another name, since gone: its snapshot is let go and
            # nothing shows it (`_keep_copies` sealed the file again: that
            # newer generation shows it here at its turn).
            log.info("%s: generation %d left the store with the name that showed it; a newer one shows it", path, gen.generation)
            node.held = None
            return False
        else:  # its staged copy was consumed under another name since unshown: stage again
            gen.move(State.FAILED)
            self.e.upload_again(gen)
            return False
        node.shown = Shown(gen.ino, gen.generation, gen.digest, gen.meta)
        node.held = None
        gen.tried.discard(at)
        if not at.startswith(META + "/"):
            self._made_parents(at)  # where the bytes landed: their directories exist in the store now
        self.e.published(gen, path)
        return True

    async def _take_back(self, gen: FileGen, at: str | None = None) -> None:
        """A try to show `gen` at `at` (at every such path if None) failed,
        and may have landed all the same (its answer lost: a call that timed
        out after the store carried it out), or left only its record, and
        the file has moved on since. Where the replica shows nothing, neither
        may the store: the removal or rename that follows would leave it
        there for good. Where it shows another generation, the store may
        hold this one instead, a generation the file did have at that name:
        the replica then says so, so that what follows (a removal, a rename,
        an exchange) moves and records the bytes the store holds. (Left as it
        was, the record a try wrote names both, its previous digest the one
        shown.) Store calls at the turn of an op that applies where it was
        tried, or of the first op after the file was dropped."""
        for path in [at] if at is not None else sorted(gen.tried):
            if path not in gen.tried:
                continue
            node = self.replica.lookup(path)
            if node is None or (isinstance(node, File) and node.shown is None):
                shown = None if path.startswith(META + "/") else Shown(gen.ino, gen.generation, gen.digest, gen.meta)
                await self.call(f"take back {path}", storeio.take_back, self.e.backend, path, shown, at=(path,))
            elif (isinstance(node, File) and node.shown.digest != gen.digest
                    and await self.call(f"look at {path}", storeio.holds, self.e.backend, path, gen.digest, at=(path,))):
                node.shown = Shown(gen.ino, gen.generation, gen.digest, gen.meta)
            gen.tried.discard(path)

    async def _staged_again(self, gen: FileGen, path: str) -> bool:
        """Cluster mode: another node's generation that cannot be shown at
        `path` from what it staged: an upload left open at another name (S3:
        the file was renamed before its turn), or nothing (its node is staging
        it again). Only its node holds the bytes: the open upload is aborted,
        that node stages the file again under a hidden key (`Engine.restage`),
        and this turn waits for it, as a turn waits for any staging. Rare: a
        name likely to be renamed is staged hidden from the start
        (`TEMPORARY`). False if the generation is dropped or lost, or leaves
        `path`, first (it is held there, and shown where it goes once staged)."""
        if gen.staged is not None:
            self._restage(gen, path)
        while True:
            change = self.e.next_change()
            if gen.state in (State.DROPPED, State.PARKED) or not self.live_at(path, gen.ino):
                return False
            if gen.staged is not None:
                return True
            await change.wait()

    def _restage_moving(self, show: list[tuple[str, File]]) -> None:
        """Cluster mode: of the held files a directory move is about to
        show, those of other nodes staged as uploads open at the names they
        leave are staged again by their nodes now, all at once, so that each
        member's wait (`_staged_again`) overlaps the others'."""
        for path, f in show:
            gen = f.held
            if gen is not None and gen.owner is not None and gen.staged is not None and gen.staged.at not in (None, path):
                self._restage(gen, path)

    def _restage(self, gen: FileGen, path: str) -> None:
        """Ask the node of `gen` to stage it again (or lose it, if that node
        is gone), and abort its upload open at a name it left (invisible:
        no order to keep)."""
        staged = gen.staged
        assert staged is not None
        log.info("%s was staged by node %s at %s, which it left before its turn: that node stages it again", path, gen.owner, staged.at)
        self.e.upload_again(gen)
        self.e.discard_soon(staged, path)

    async def _show_copy(self, path: str, node: File) -> bool:
        """Show `node` at `path` as another name of its inode shows it (a
        hard link), if the mount has it there. True if shown."""
        if node.shows_own or not self.live_at(path, node.ino):
            return False
        newer = next((n.held for _, n in self.replica.nodes_of(node.ino) if isinstance(n, File) and n is not node and n.held is not None
                      and n.held.ino == node.ino and n.held.state is not State.DROPPED), None)
        if newer is not None:  # a newer generation of it waits under another name: that one, not the bytes shown before it
            node.held = newer
            return await self._materialize(path, node)
        found = next(((p, n) for p, n in self.replica.nodes_of(node.ino) if isinstance(n, File) and n is not node and n.shows_own), None)
        if found is None:
            return False
        source, src = self._now_at(*found), found[1]
        assert isinstance(src, File) and src.shown is not None
        shown = src.shown
        replaced = node.shown.digest if node.shown is not None else None  # another file's bytes, kept there until now
        rec = Record.of(path, "file", shown.meta, current=shown.digest, previous=replaced)
        await self.call(f"copy {source} to {path}", storeio.show, self.e.backend, rec, source, path, False, at=(path,))
        node.shown = Shown(shown.ino, shown.generation, shown.digest, shown.meta)
        return True

    async def _keep_copies(self, node: File) -> None:
        """Before `node`'s bytes go from the store (deleted, replaced): every
        other name the mount has for its inode that the store does not show
        yet (a hard link), or that waits to show a generation published only
        at `node`'s name, takes a copy; or the bytes, evicted from RAM once
        published, would be nowhere."""
        going = node.shown
        if going is None or going.ino != node.ino:
            return
        others = [(path, n) for path, n in self.replica.nodes_of(node.ino) if n is not node and isinstance(n, File)]
        for path, n in others:
            if not n.shows_own:
                await self._show_copy(path, n)
            elif n.held is not None and n.held.state is State.PUBLISHED:
                await self._materialize(path, n)
        if any(n.shows_own and n.shown.generation >= going.generation for _, n in others):
            return
        ns = self.e.ns
        if self.e.link is None and node.ino not in self.e.pending and ns.paths_of(node.ino):
            # A name the mount has moved on from, its turn to come: the bytes
            # come back to RAM while the store still has them, and go again as
            # a new generation under the names the file has when its turn comes.
            await self.e.load(node.ino)
            if ns.reseal(node.ino):
                if self.current is not None:
                    self.current.resealed = self.e.pending.get(node.ino)
                log.info("%s: sealed again from the store's last copy, which goes now, for its other names", self.replica.path_of(node))
        elif self._held_in_store_only(node.ino):
            # Deleted or replaced in the mount while open or being opened (a
            # reader of the checkpoint a rotation deletes, an mmap of a
            # replaced file): it stays readable until its last close, and the
            # store's copy, about to go, is its only one. Into RAM (or the
            # spill directory) first; a load that fails for good (retried
            # already) leaves the reader its error, not the store a removal
            # that never happens.
            try:
                await self.e.load(node.ino)
            except OSError as exc:
                if ns.held_unnamed(node.ino):  # (else released meanwhile: nothing to keep)
                    log.warning("%s: deleted in the mount while open, and not in RAM: cannot keep it for its reader (%s)",
                                self.replica.path_of(node), exc)

    def _held_in_store_only(self, ino: int) -> bool:
        """A file with no name left in the mount that a process may still
        read (`held_unnamed`), whose only copy is the store's: it must come
        back to RAM before that copy goes (`_keep_copies`). Not one read in
        place from a local store (`kept_in_place`): its descriptor keeps
        the bytes when the name goes. In cluster mode only this node's
        readers count (what the others hold open is not known here), and
        not of a file whose newest generation another node still holds
        (its load would wait for this very publisher)."""
        if not self.e.ns.held_unnamed(ino) or self.e.ns.resident(ino) or self.e.residency.kept_in_place(ino):
            return False
        gen = self.e.pending.get(ino)
        return self.e.link is None or gen is None or gen.owner is None

    def _shown_source(self, gen: FileGen, exclude: Node) -> str | None:
        """Where the store shows `gen` under another name (a hard link's);
        inside a directory being moved, where it is now. The name it was
        first shown at comes first: after a takeover, the replica gives
        every name of the file the generation last published, and only
        that name is known to hold its bytes."""
        found = None
        for path, other in self.replica.nodes_of(gen.ino):
            if (other is not exclude and isinstance(other, File) and other.shown and other.shown.ino == gen.ino
                    and other.shown.generation == gen.generation):
                if path == gen.shown_at:
                    return self._now_at(path, other)
                found = found or self._now_at(path, other)
        return found

    def _now_at(self, path: str, node: Node) -> str:
        """Where the store has the bytes `node` shows at `path` (`relocated`)."""
        r = self.relocated
        if r is not None and path.startswith(r[0] + "/") and (r[2] is None or id(node) in r[2]):
            return r[1] + path[len(r[0]) :]
        return path

    def _record(self, path: str, gen: FileGen, node: File) -> Record:
        previous = node.shown.digest if node.shown is not None else None
        staged = gen.staged
        source = f"staged:{staged.token}" if staged is not None and staged.token else f"put:{self.e.backend.daemon_id}"
        return Record.of(path, "file", gen.meta, current=gen.digest, previous=previous, written_ns=int(gen.sealed_at * 1e9), source=source)

    def _made_parents(self, path: str) -> None:
        """The directories holding `path` exist in the store (a publication
        creates them)."""
        d = self.replica.lookup(path.rsplit("/", 1)[0]) if "/" in path else self.replica.root
        while isinstance(d, Dir) and not d.made:
            d.made = True
            d = d.parent

    def _marker_blocked(self, path: str) -> str:
        """Why the completion marker at `path` waits for something no step
        of write-back resolves ("" if it does not): a file in its directory
        tree is parked, or a rename, exchange or hard link there could never
        be applied to the store (skipped: what it vouches for is not where
        the mount has it)."""
        if not (self.parked or self.e.skipped) or not self._is_marker(path):
            return ""
        base = path.rsplit("/", 1)[0] if "/" in path else ""
        for gen in self.parked:
            for p in self.e.ns.paths_of(gen.ino):
                if not base or p.startswith(base + "/"):
                    return f"held back: {p}, in its directory tree, failed for good (parked)"
        for op in self.e.skipped.values():
            if isinstance(op, (Rename, Exchange, Link)) and (not base or _overlap((base,), _paths(op))):
                return f"held back: the {kind(op)} of {op.path}, in its directory tree, could not be applied to the store"
        return ""

    def _vouches_for_held(self, path: str, gen: FileGen) -> bool:
        """Whether a completion marker at `path` would vouch for a file sealed
        before it, in its directory tree, that the store does not show yet
        because it was deleted or renamed in the mount after its seal, and
        that removal or rename has not had its turn: the store would show the
        marker without its data, a moment the mount never had (C3)."""
        if not self._is_marker(path):
            return False
        base = path.rsplit("/", 1)[0] + "/" if "/" in path else ""
        d = self.replica.lookup(base.rstrip("/")) if base else self.replica.root
        if isinstance(d, Dir) and any(isinstance(n, File) and n.held is not None and n.held is not gen and n.held.seq < gen.seq
                                      and n.held.state is not State.DROPPED for _, n in self.replica.walk(d)):
            return True  # renamed away: shown again when the rename has its turn
        for other in self.e.unsettled.values():  # deleted before its turn: never shown, its removal not applied yet
            if other.seq >= gen.seq:
                break
            if (other.state is State.DROPPED and other.ino != gen.ino and not self.settled(other)
                    and any(n.startswith(base) for n in other.names)):
                return True
        return False

    async def _show_waiting_markers(self) -> None:
        """Show the markers that waited, in the order they were sealed, once
        what they vouch for is shown, or gone from the replica (a removal had
        its turn), and no file in their tree is parked (it was deleted,
        rewritten or moved out of it, or published at last)."""
        for node in sorted(self.waiting_markers, key=lambda n: n.held.seq if n.held is not None else 0):
            path = self.replica.path_of(node)
            gen = node.held
            if path is None or gen is None or gen.state is State.DROPPED:
                self.waiting_markers.discard(node)
            elif not self._marker_blocked(path) and not self._vouches_for_held(path, gen):
                self.waiting_markers.discard(node)
                self.current = gen
                try:
                    await self._materialize(path, node)
                except GiveUp:
                    pass  # parked, loudly
                finally:
                    self.current = None

    def held_back(self, gen: FileGen) -> str:
        """Why a completion marker whose turn came waits for a parked file or
        a skipped change it may vouch for ("" if it does not)."""
        if gen.seq > self.position:
            return ""
        return next((why for p in self.e.ns.paths_of(gen.ino) if (why := self._marker_blocked(p))), "")

    # -- namespace ops ----------------------------------------------------------
    async def _apply(self, op: Op) -> None:
        log.debug("apply %s", op)
        if isinstance(op, Rename):
            await self._clear_way((op.src, op.dst))
        elif isinstance(op, Exchange):
            await self._clear_way((op.a, op.b))
        elif isinstance(op, Mkdir | Symlink | Link):
            await self._clear_way((op.name,))
        if isinstance(op, Rename):
            await self._rename(op)
        elif isinstance(op, Remove):
            node = self.replica.lookup(op.name)
            if node is None or (node.ino and node.ino != op.ino):
                if self.deferred:
                    self.not_held.append(op.seq)  # ends a range of those held back
                    self._removals_held = None
                return  # nothing of that file in the replica (never sealed)
            if self.deferred or self._gated(op.seq):
                log.debug("removal of %s waits for earlier generations", op.name)
                self.hold_back(node, op)
                return
            await self._remove(node, op)
        elif isinstance(op, Mkdir):
            node = self.replica.lookup(op.name)
            if not isinstance(node, Dir):
                node = Dir(op.ino)
                self.replica.bind(op.name, node)
            elif node.ino != op.ino:
                self.replica.rebind_ino(node, op.ino)
            live = self.e.ns.inode_at(op.name)
            if live is not None and live.ino == op.ino and not node.made:  # C4: only if it still exists
                await self.call(f"mkdir {op.name}", self.e.backend.mkdir, op.name, at=(op.name,))
                node.made = True
                self._made_parents(op.name)
        elif isinstance(op, Symlink):
            await self._symlink(op.name, RLink(op.ino, target=op.target, meta=op.meta))
        elif isinstance(op, Link) and (link := self._symlink_of(op.ino)) is not None:
            # Another name for a symlink (link(2) of a symlink: `cp -al`, rsync --link-dest): a record of its own,
            # as a hard-linked file's names each get a copy
            await self._symlink(op.name, RLink(op.ino, target=link.target, meta=link.meta))
        elif isinstance(op, Link):
            node = File(op.ino)
            self.replica.bind(op.name, node)
            if not await self._show_copy(op.name, node):
                held = next((n.held for _, n in self.replica.nodes_of(op.ino) if isinstance(n, File) and n.held is not None), None)
                node.held = held
                await self._materialize(op.name, node)
        elif isinstance(op, Exchange):
            await self._exchange(op)
        elif isinstance(op, Attrs):  # the manifest keeps modes, owners and mtimes (C8: the data is plain)
            await self._attrs(op)

    async def _rename(self, op: Rename) -> None:
        node = self.replica.lookup(op.src)
        target = self.replica.lookup(op.dst)
        if isinstance(target, RLink) and target.shown and not (isinstance(node, File) and node.shown is not None) and not isinstance(node, RLink):
            # A symlink replaced by a file the store cannot show yet: its record goes (a shown
            # file's record replaces it below; a symlink's, in its branch)
            await self.call(f"record {op.dst}", manifest.delete, self.e.backend, op.dst, at=(op.dst,))
            target.shown = False
        if isinstance(target, File) and target.shown is not None and target.ino != op.ino:
            await self._keep_copies(target)  # its bytes at dst are about to be replaced
        if node is None:
            # Never sealed under that name (a rename before the release that
            # seals it): the store keeps what it shows at dst until the new
            # file's generation replaces it, so there is no window without it.
            if isinstance(target, File):
                self.replica.rebind_ino(target, op.ino)
            elif not op.is_dir:
                self.replica.bind(op.dst, File(op.ino))
            return
        if isinstance(node, Dir):
            await self._rename_dir(op, node)
            await self._retry_moved(op.dst)
            return
        backend = self.e.backend
        if isinstance(node, File):
            if node.shown is not None:
                # the record first, naming the bytes dst holds until the move (a crash between)
                replaced = target.shown.digest if isinstance(target, File) and target.shown is not None else None
                rec = Record.of(op.dst, "file", node.shown.meta, current=node.shown.digest, previous=replaced)
                await self.call(f"move {op.src} to {op.dst}", storeio.show, backend, rec, op.src, op.dst, True, nbytes=self._size(node), at=(op.src, op.dst))
            elif isinstance(target, File) and target.shown is not None:
                node.shown = target.shown  # the old bytes stay until the new ones are sealed
        elif isinstance(node, RLink):
            # A symlink is a record only: the file it replaces must go from the store itself
            if isinstance(target, File) and target.shown is not None:
                await self.call(f"delete {op.dst}", storeio.delete, backend, op.dst, target.shown, at=(op.dst,))
            was = node.shown
            if self.live_at(op.dst, node.ino):  # shown now even if its own turn found it gone from its first name
                await self.call(f"record {op.dst}", manifest.write, backend, Record.of(op.dst, "symlink", node.meta, target=node.target), at=(op.dst,))
                node.shown = True
            elif isinstance(target, RLink) and target.shown:
                await self.call(f"record {op.dst}", manifest.delete, backend, op.dst, at=(op.dst,))
            if was:
                await self.call(f"record {op.src}", manifest.delete, backend, op.src, at=(op.src,))
        self.replica.bind(op.dst, node)
        if isinstance(node, File):
            await self._materialize(op.dst, node)
            await self._retry_moved(op.dst)

    @staticmethod
    def _size(node: File) -> int:
        return node.shown.digest.size if node.shown is not None and node.shown.digest is not None else 0

    def _is_marker(self, path: str) -> bool:
        name = path.rsplit("/", 1)[-1]
        return any(fnmatch.fnmatchcase(name, m) for m in self.markers)

    def _showable(self, path: str, f: Node) -> bool:
        return (isinstance(f, File) and f.held is not None and f.held.state not in (State.DROPPED, State.PARKED)
                and self.live_at(path, f.ino) and not self._marker_blocked(path))

    async def _rename_dir(self, op: Rename, node: Dir) -> None:
        """A directory becomes visible under its new name as a unit."""
        backend = self.e.backend
        members = list(self.replica.walk(node))
        show = [(rel, f) for rel, f in members if self._showable(f"{op.dst}/{rel}", f)]
        hints: list[Record] = []  # records at the new names that name the move, for a crash (a local store's)
        if backend.dirs:
            # Assemble everything under the old name (or, if the store never
            # had it, a hidden directory), then one rename(2).
            in_store = node.made or any(isinstance(f, File) and f.shown is not None for _, f in members)
            base = op.src if in_store else await self.call(f"assemble {op.dst}", backend.unit_dir)
            self.relocated = (op.src, base, None) if base != op.src else None
            try:
                await self._assemble_group(op.dst, show, base)
                for rel, f in show:  # what the groups did not show
                    assert isinstance(f, File)
                    await self._materialize(f"{op.dst}/{rel}", f, into=f"{base}/{rel}")
            finally:
                self.relocated = None
            for rel, d in members:  # made in the mount after it moved there: their Mkdir's turn could not
                if isinstance(d, Dir) and not d.made and self.live_at(f"{op.dst}/{rel}", d.ino):
                    await self.call(f"mkdir {op.dst}/{rel}", backend.mkdir, f"{base}/{rel}", at=(f"{base}/{rel}",))
                    d.made = True
            shown = [(rel, f) for rel, f in members if isinstance(f, File) and f.shown is not None]
            links = [(rel, f) for rel, f in members if isinstance(f, RLink) and f.shown]
            # Records first: a crash leaves data with records (stray records are cleaned at mount).
            recs = [Record.of(f"{op.dst}/{rel}", "file", f.shown.meta, current=f.shown.digest, source=f"move:{base}/{rel}")
                    for rel, f in shown if isinstance(f, File) and f.shown is not None]
            new_links = [(rel, f) for rel, f in members if isinstance(f, RLink) and (f.shown or self.live_at(f"{op.dst}/{rel}", f.ino))]
            recs += [Record.of(f"{op.dst}/{rel}", "symlink", f.meta, target=f.target,
                               source=storeio.dir_move_source(base, f"{op.src}/{rel}", op.dst)) for rel, f in new_links]
            # The directories' too, as recorded at the old names
            recs += [Record.of(_under(op.dst, rel), "dir", d.recorded, source=storeio.dir_move_source(base, _under(op.src, rel), op.dst))
                     for rel, d in [("", node), *members] if isinstance(d, Dir) and d.recorded is not None]
            await self._write_records(recs)
            hints = [r for r in recs if r.kind != "file"]
            for _rel, f in new_links:
                f.shown = True
            if not await self.call(f"move {base} to {op.dst}", backend.move_dir, base, op.dst, at=(base, op.dst)):
                log.info("moving %s to %s member by member (the store has something in the way)", base, op.dst)
                for rel, _f in sorted(shown, key=lambda rf: self._is_marker(rf[0])):
                    assert isinstance(_f, File) and _f.shown is not None
                    src, dst = f"{base}/{rel}", f"{op.dst}/{rel}"
                    await self.call(f"move {src}", storeio.move, backend, src, dst, _f.shown.digest, at=(src, dst))
                for rel, f in sorted(members, key=lambda rf: -rf[0].count("/")):
                    if isinstance(f, Dir):
                        if f.made:  # empty directories persist
                            await self.call(f"mkdir {op.dst}/{rel}", backend.mkdir, f"{op.dst}/{rel}", at=(f"{op.dst}/{rel}",))
                        await self.call(f"rmdir {base}/{rel}", backend.rmdir, f"{base}/{rel}", at=(f"{base}/{rel}",))
                if node.made:  # empty directories persist (and one the store lost comes back)
                    await self.call(f"mkdir {op.dst}", backend.mkdir, op.dst, at=(op.dst,))
                await self.call(f"rmdir {base}", backend.rmdir, base, at=(base,))
            # The old names' records: the files' where they were assembled at
            # the old name; the symlinks' always, even where the store has no
            # directory there (only their records: a crash after the move).
            await self._delete_records([f"{op.src}/{rel}" for rel, _f in (shown + links if base == op.src else links)])
            node.made = True
        else:
            # Object stores: members first, completion markers last. A member
            # moved is at its new path (before the directory is): a hard
            # link's copy of it comes from there. Those showing their own
            # bytes move first, in every try of the op: a copy's source is
            # never one an earlier try moved away.
            self._restage_moving([(f"{op.dst}/{rel}", f) for rel, f in show])
            moved: set[int] = set()
            self.relocated = (op.src, op.dst, moved)
            try:
                def order(rf: tuple[str, Node]) -> tuple[bool, bool]:
                    return self._is_marker(rf[0]), not (isinstance(rf[1], File) and rf[1].shows_own)

                moved |= await self._assemble_group(op.dst, show, op.dst)  # at their new names already
                showing = {id(f) for _, f in show}  # not `in show` for each member: a directory of thousands took seconds
                for rel, f in sorted(members, key=order):
                    if id(f) in moved:
                        continue
                    src, dst = f"{op.src}/{rel}", f"{op.dst}/{rel}"
                    was = f.shown if isinstance(f, File) else None
                    if isinstance(f, File) and id(f) in showing and (await self._materialize(dst, f) or f.shown is not was):
                        if was is not None:  # shown anew (or the store's newer bytes kept) at the new path: these go
                            await self.call(f"delete {src}", storeio.delete, backend, src, was, at=(src,))
                    elif isinstance(f, File) and f.shown is not None:  # what the store shows moves with the directory
                        rec = Record.of(dst, "file", f.shown.meta, current=f.shown.digest)
                        await self.call(f"move {src} to {dst}", storeio.show, backend, rec, src, dst, True, nbytes=self._size(f),
                                        at=(src, dst))
                    elif isinstance(f, RLink) and (f.shown or self.live_at(dst, f.ino)):
                        rec = Record.of(dst, "symlink", f.meta, target=f.target)
                        await self.call(f"record {dst}", manifest.write, backend, rec, at=(dst,))
                        if f.shown:
                            await self.call(f"record {src}", manifest.delete, backend, src, at=(src,))
                        f.shown = True
                    moved.add(id(f))
            finally:
                self.relocated = None
            # Stores with folders (SeaweedFS) keep those of the old name, and a
            # file later taking one's name could never be completed there.
            folders = [f"{op.src}/{rel}" for rel, d in sorted(members, key=lambda rf: -rf[0].count("/")) if isinstance(d, Dir)]
            await self.call(f"rmdir {op.src}", backend.rmdirs, [*folders, op.src], at=(op.src,))
        for rel, d in [("", node), *((rel, n) for rel, n in members if isinstance(n, Dir))]:
            if d.may_be_recorded:  # records are by path: the old path's goes
                old = _under(op.src, rel)
                await self.call(f"record {old}", manifest.delete, backend, old, at=(old,))
                d.unsure = False
                if not backend.dirs:  # the new path's is written at the next sync (a local store's was, before the move)
                    d.recorded = None
        if hints:
            # The move is settled: its records at the new names no longer name
            # it. Left naming it, a symlink or directory made again later at
            # an old name, as it was there, read at a restart as a crash's
            # leftover of the move, and went (`storeio._left_by_a_directory_move`).
            await self._write_records([r._replace(source="") for r in hints])
        there = self.replica.lookup(op.dst)
        if isinstance(there, Dir) and there is not node:  # what a gone publisher moved there already stays known
            self.replica.merge_moved(node, there)
        self.replica.bind(op.dst, node)
        self._made_parents(op.dst)
        for rel, f in members:  # hard links whose Link's turn found them elsewhere
            if isinstance(f, File) and not f.shows_own and f.held is None:
                await self._show_copy(f"{op.dst}/{rel}", f)

    async def _assemble_group(self, dst: str, show: list[tuple[str, Node]], base: str) -> set[int]:
        """A directory renamed before its files' turn (Orbax's temporary
        directory): those of its files that are plain generations go into
        `base` by group commits, as `_publish_group` shows the queue's, not
        one store call (and on a local store three fsyncs) each. `base` is
        where a local store assembles the directory (its old name in the
        store, or a hidden directory), and an object store's new name: there
        only files the store never showed go (one shown at the old name
        moves, and its old copy goes, one at a time). The rest (a marker, a
        hard link's second name, a file shown elsewhere, another node's) and
        all of a failed group are left to `_materialize`, one at a time.
        Returns the files shown (their ids)."""
        recorded = not base.startswith(META + "/")  # a hidden directory's files get their records at their final paths
        moving = base == dst  # an object store: each file goes to its new name
        plain: list[tuple[str, File, FileGen]] = []
        seen: set[int] = set()
        for rel, f in show:
            gen = f.held if isinstance(f, File) else None
            path = f"{dst}/{rel}"
            if (gen is None or id(gen) in seen or gen.ino != f.ino or gen.owner is not None or gen.staged is None
                    or (moving and f.shown is not None)
                    or gen.state in (State.DROPPED, State.PARKED, State.PUBLISHED) or self._is_marker(path)
                    or not self.live_at(path, gen.ino) or self._vouches_for_held(path, gen) or self._shown_source(gen, exclude=f) is not None):
                continue
            seen.add(id(gen))
            plain.append((rel, f, gen))
        done: set[int] = set()
        for i in range(0, len(plain), GROUP_MAX):
            batch = plain[i : i + GROUP_MAX]
            items = [(self._record(f"{base}/{rel}", gen, f), gen.staged, f"{base}/{rel}", gen.pieces) for rel, f, gen in batch]
            if not await self._in_one_call(f"publish {len(batch)} files into {base}", items, [gen for _, _, gen in batch], recorded):
                continue  # these go one at a time
            lines: list[str] = []
            try:
                for rel, f, gen in batch:
                    _shown(f, gen)
                    if recorded:
                        self._made_parents(f"{base}/{rel}")
                    self.e.published(gen, f"{dst}/{rel}", lines)
                    done.add(id(f))
            finally:
                self.e.log_published(lines)
        return done

    async def _write_records(self, recs: list[Record]) -> None:
        """Write these records, many to a store call, each call's made
        durable together (`manifest.write_many`)."""
        for i in range(0, len(recs), RECORDS_PER_CALL):
            batch = recs[i : i + RECORDS_PER_CALL]
            what = f"record {batch[0].path}" if len(batch) == 1 else f"record {len(batch)} entries from {batch[0].path}"
            await self.call(what, manifest.write_many, self.e.backend, batch, nbytes=len(batch) * RECORD_NBYTES,
                            at=tuple(r.path for r in batch))

    async def _delete_records(self, paths: list[str]) -> None:
        for i in range(0, len(paths), RECORDS_PER_CALL):
            batch = paths[i : i + RECORDS_PER_CALL]
            what = f"record {batch[0]}" if len(batch) == 1 else f"delete the records of {len(batch)} entries from {batch[0]}"
            await self.call(what, manifest.delete_many, self.e.backend, batch, nbytes=len(batch) * RECORD_NBYTES, at=tuple(batch))

    async def _exchange(self, op: Exchange) -> None:
        """Each side's whole tree (a file, a directory, a symlink, or
        nothing the store has) takes the other's name. A local store swaps
        them in one rename(2) (or moves the side it has); an object store
        moves each file through a hidden name. Then the records follow: each
        file's and symlink's at its new path, the directories' at the next
        sync; a record at an old path that nothing replaced goes. The store
        applies it as a plan kept while it runs (`exchange`): a crash, or a
        takeover, finishes it rather than apply it again or leave it halfway."""
        a, b = self.replica.lookup(op.a), self.replica.lookup(op.b)
        backend = self.e.backend
        sides = ((op.a, op.b, a), (op.b, op.a, b))  # (old path, new path, node)
        members = {old: [("", node), *self.replica.walk(node)] if node is not None else [] for old, _, node in sides}
        files = {old: [(rel, n) for rel, n in ms if isinstance(n, File) and n.shown is not None] for old, ms in members.items()}
        plan = exchange.Plan(op.seq, f"{op.a} and {op.b}")
        records_first, store_changes, moves_after = plan.phases

        # An object store moves each file through a hidden name: every file of
        # both sides is copied to one first, then the originals go, then each
        # comes back at its new path from its hidden copy (one side's file
        # may take a name where the other had a directory: nothing of either
        # may be in the way).
        hidden = {} if backend.dirs else {_under(old, rel): backend.hidden_name() for old, fs in files.items() for rel, _ in fs}
        deleted: set[str] = set()  # with their records
        # The records first, each naming what its path may hold until the move
        # (the bytes of the file leaving it): a crash between the store's swap
        # and these writes would have left each side checked against the other's.
        leaving = {_under(old, rel): f.shown.digest for old, fs in files.items() for rel, f in fs if f.shown is not None}
        for old, new, _node in sides:
            for rel, f in files[old]:
                assert isinstance(f, File) and f.shown is not None
                path = _under(new, rel)
                source = f"hidden:{hidden[_under(old, rel)]} {_under(old, rel)}" if hidden else f"move:{_under(old, rel)}"
                plan.record(0, Record.of(path, "file", f.shown.meta, current=f.shown.digest, previous=leaving.get(path), source=source))
        made: list[Dir] = []
        if backend.dirs:
            there = {old: bool(files[old]) or (isinstance(node, Dir) and node.made) for old, _, node in sides}
            if there[op.a] and there[op.b]:
                store_changes.append(["swap", op.a, op.b, None])
            for old, new, node in sides:
                if not there[old] or there[new]:
                    continue
                moving = [[rel, exchange.digest_arg(f.shown.digest)] for rel, f in files[old]]  # files: each shows its bytes
                store_changes.append(["move-tree", old, new, moving] if isinstance(node, Dir) else ["move", old, new, moving[0][1]])
            for _old, new, _node in sides:  # made in the mount after it moved there: their Mkdir's turn could not
                for rel, d in members[_old]:
                    if isinstance(d, Dir) and not d.made and self.live_at(_under(new, rel), d.ino):
                        store_changes.append(["mkdir", _under(new, rel)])
                        made.append(d)
        else:
            records_first.extend(["copy", src, tmp] for src, tmp in hidden.items())
            dests = {_under(new, rel) for old, new, _ in sides for rel, _ in files[old]}
            for old, _new, _node in sides:
                for rel, f in files[old]:
                    assert isinstance(f, File) and f.shown is not None
                    src = _under(old, rel)
                    if src in dests:  # its record names the bytes that come: only these go
                        store_changes.append(["delete", src])
                    else:
                        store_changes.append(["delete-file", src, exchange.digest_arg(f.shown.digest), list(f.shown.meta)])
                        deleted.add(src)
            # The folders of a directory side go before anything takes their names: a store with
            # folders (SeaweedFS) keeps them emptied, and an object put at such a name can never be
            # replaced by a completed upload (`Backend.rmdir`)
            folders = [_under(old, rel) for old, _new, _node in sides for rel, n in members[old] if isinstance(n, Dir)]
            if folders:
                store_changes.append(["rmdirs", sorted(folders, key=lambda p: -p.count("/"))])
            for old, new, _node in sides:
                for rel, f in files[old]:
                    assert isinstance(f, File) and f.shown is not None
                    moves_after.append(["move", hidden[_under(old, rel)], _under(new, rel), exchange.digest_arg(f.shown.digest)])
        shown_links: list[RLink] = []
        written: set[str] = set()
        for _old, new, _node in sides:
            for rel, n in members[_old]:
                path = _under(new, rel)
                if isinstance(n, File) and n.shown is not None:
                    plan.record(2, Record.of(path, "file", n.shown.meta, current=n.shown.digest, source=f"move:{_under(_old, rel)}"))
                elif isinstance(n, RLink) and (n.shown or self.live_at(path, n.ino)):
                    plan.record(2, Record.of(path, "symlink", n.meta, target=n.target))
                    shown_links.append(n)
                else:
                    continue
                written.add(path)
        for old, _new, _node in sides:
            for rel, n in members[old]:
                path = _under(old, rel)
                recorded = ((isinstance(n, File) and n.shown is not None) or (isinstance(n, RLink) and n.shown)
                            or (isinstance(n, Dir) and n.may_be_recorded))
                if recorded and path not in written and path not in deleted:
                    moves_after.append(["unrecord", path])
        await self.call(f"exchange {op.a} and {op.b}", exchange.begin, backend, plan, at=(op.a, op.b))
        for link in shown_links:
            link.shown = True
        for d in made:
            d.made = True
        for ms in members.values():
            for _rel, n in ms:
                if isinstance(n, Dir):
                    n.recorded, n.unsure = None, False  # written at its new path at the next sync
                    self.dirty.add(n)
        for node in (a, b):
            if node is not None:
                self.replica.detach(node)
        for old, new, node in sides:
            if node is not None:
                self.replica.bind(new, node)
                if files[old] or (isinstance(node, Dir) and node.made):  # something of it is in the store at `new` now
                    self._made_parents(new)
        for _old, new, _node in sides:  # generations whose turn passed while they were held under these names, hard links
            for rel, n in members[_old]:
                if isinstance(n, File) and (not n.shows_own or self._showable(_under(new, rel), n)):
                    await self._materialize(_under(new, rel), n)

    # -- removals wait ----------------------------------------------------------
    def _gated(self, seq: int) -> bool:
        """Whether the removal at `seq` must wait. The store skips what the
        mount deleted or replaced before its turn (C4), so it may jump from
        one moment of the mount to a later one. A removal is applied only
        where the store can stand: at a journal position after it before
        which every generation is published or was gone from the mount
        (`_cut`, or the first unsettled generation). That every generation
        sealed before the removal is settled is not enough: a keep-N
        rotation faster than write-back deletes each new checkpoint before
        its turn, and the old one's removal then left the store with no
        complete checkpoint while the newest was on its way (a kill -9 soak)."""
        self.trim_settled()
        front = next(iter(self.e.unsettled), None)  # the first generation not settled
        if front is None:  # all settled, each gone by a deletion the publisher passed: it can stand where it is
            return False
        return seq > (front if self._reach <= front else self._cut)

    def trim_settled(self) -> None:
        """Settled generations leave the front of `unsettled` (in seal
        order), so what is in flight stays cheap to look at; what `_gated`
        needs of them is kept (`_reach`, `_cut`)."""
        unsettled = self.e.unsettled
        while unsettled:
            first = next(iter(unsettled.values()))
            if not self.settled(first):
                return
            unsettled.popitem(last=False)
            if self._reach <= first.seq:  # everything sealed before it is in the store, or gone from the mount before it
                self._cut = first.seq
            self._reach = max(self._reach, _gone_at(first))

    def settled(self, gen: FileGen) -> bool:
        if gen.state is State.PUBLISHED:
            return True
        if gen.state is State.DROPPED:
            if gen.superseded_by is not None:
                return self.settled(gen.superseded_by)
            return gen.dropped_by <= self.position
        return False

    def blocked_by_parked(self) -> bool:
        """What waits for the first unsettled generation waits for a parked
        one: it, or the one that superseded it before its turn; or for a
        completion marker held back by one (or by a change the store could
        not take: `held_back`)."""
        self.trim_settled()
        if not self.e.unsettled:
            return False
        gen = next(iter(self.e.unsettled.values()))
        while gen.state is State.DROPPED and gen.superseded_by is not None:
            gen = gen.superseded_by
        return gen.state is State.PARKED or bool(self.held_back(gen))

    def hold_back(self, node: Node | None, op: Remove) -> None:
        """`op` waits (`deferred`); removals are held back in journal order."""
        assert not self.deferred or self.deferred[-1][1].seq < op.seq
        self.deferred.append((node, op))
        self._removals_held = None

    def removals_held(self, upto: int) -> HeldBack:
        """The removals held back up to `upto`, as a progress report names
        them (made again only when they change: reports come often, and
        behind a parked file thousands may wait)."""
        key = upto if self.deferred and upto < self.deferred[-1][1].seq else None
        if self._removals_held is None or self._removals_held[0] != key:
            held = itertools.takewhile(lambda seq: seq <= upto, (op.seq for _, op in self.deferred))
            self._removals_held = (key, HeldBack.of(held, self.not_held))
        return self._removals_held[1]

    async def _release_deferred(self) -> None:
        while self.deferred and not self._gated(self.deferred[0][1].seq):
            await self._remove_waiting(self.deferred[0])
        if self.deferred and not self.e.queue:
            self.e.notify()  # flushes waiting on them learn that they are stuck

    async def _clear_way(self, paths: Iterable[str]) -> None:
        """Waiting removals at or above or below `paths` happen now, before
        the op that takes those names again: the store cannot keep the old
        entry there (a directory where the file was, a file where the
        directory was), and a removal released later would delete the new
        entry. The mount removed them before that op, so the store still
        follows the mount's order; only the wait for the generations that
        superseded earlier ones is cut short, for these names alone."""
        paths = tuple(paths)
        for item in list(self.deferred):
            path = self.replica.path_of(item[0]) if item[0] is not None else None
            if path is not None and _overlap((path,), paths):
                log.debug("removal of %s happens now: the name is taken again", path)
                await self._remove_waiting(item)

    async def _remove_waiting(self, item: tuple[Node | None, Remove]) -> None:
        node, op = item
        outer, self.current = self.current, op
        try:
            if node is not None and self.replica.attached(node):
                await self._remove(node, op)
        except GiveUp:
            pass  # skipped, loudly
        finally:
            self.current = outer
        self._removals_held = None
        if self.deferred[0] is item:
            self.deferred.popleft()
            if self.deferred:
                del self.not_held[:bisect.bisect_left(self.not_held, self.deferred[0][1].seq)]
            else:
                self.not_held.clear()
        else:
            self.deferred = collections.deque(x for x in self.deferred if x is not item)
            bisect.insort(self.not_held, op.seq)  # applied early: it ends a range of those held back
        op.done.set()
        self.e.notify()

    async def _remove_group(self) -> bool:
        """Removals of published files at the head of the queue (the rmtree
        of an old checkpoint) with nothing else to do (no earlier generation
        to wait for, no other name of the file, nothing waiting to show
        there, no process reading it from the store): applied with a few
        store calls for all of them (`storeio.delete_many`), not three each,
        which held everything after a rotation of thousands of files for
        seconds. False if there are fewer than two, or the call failed: they
        then go one at a time."""
        if self.deferred or self.e.queue[0].seq <= self.single_until:
            return False
        group: list[tuple[Remove, File]] = []
        for op in self.e.queue:
            if len(group) == RECORDS_PER_CALL or not isinstance(op, Remove) or self._gated(op.seq):
                break
            node = self.replica.lookup(op.name)
            if not (isinstance(node, File) and node.ino == op.ino and node.shown is not None and node.shown.ino == node.ino
                    and node.held is None and len(self.replica.nodes_of(node.ino)) == 1 and not self.e.ns.paths_of(node.ino)
                    and not self._held_in_store_only(node.ino)):  # (one still read: kept first, `_remove`)
                break
            group.append((op, node))
        if len(group) < 2:
            return False
        files = [(op.name, node.shown) for op, node in group if node.shown is not None]
        what = f"delete {len(files)} files from {files[0][0]}"
        try:
            await self._fenced(what, storeio.delete_many, self.e.backend, files, nbytes=len(files) * RECORD_NBYTES,
                               at=tuple(path for path, _ in files))
        except Exception as exc:
            log.debug("%s: not done together (%s): one at a time", what, exc)
            self.single_until = group[-1][0].seq
            return False
        for op, node in group:
            self.replica.detach(node)
            self._complete(op)
            self._dirty_after(op)
        return True

    async def _remove(self, node: Node, op: Remove) -> None:
        path = self.replica.path_of(node)
        if path is None:
            return
        backend = self.e.backend
        if isinstance(node, File):
            if node.shown is not None:
                await self._keep_copies(node)
                await self.call(f"delete {path}", storeio.delete, backend, path, node.shown, at=(path,))
            elif node.held is not None and node.held.tries and not path.startswith(META + "/"):
                # A failed try (a parked file) may have left its record with no file under it
                await self.call(f"record {path}", manifest.delete, backend, path, at=(path,))
        elif isinstance(node, RLink):
            if node.shown:
                await self.call(f"record {path}", manifest.delete, backend, path, at=(path,))
        elif isinstance(node, Dir):
            await self.call(f"rmdir {path}", backend.rmdir, path, at=(path,))
            if node.may_be_recorded:
                await self.call(f"record {path}", manifest.delete, backend, path, at=(path,))
                node.recorded, node.unsure = None, False
            self.dirty.discard(node)
        self.replica.detach(node)

    # -- parked generations -----------------------------------------------------
    def park(self, gen: FileGen) -> None:
        self.parked.add(gen)
        self.retry_parked_at = trio.current_time() + self.e.retry.parked_s

    async def _retry_parked(self) -> None:
        self.retry_parked_at = trio.current_time() + self.e.retry.parked_s
        for gen in list(self.parked):
            if gen.state is not State.PARKED:
                self.parked.discard(gen)
                continue
            if gen.lost:
                continue  # lost with its node, for good (even if that node comes back: it was told)
            log.info("retrying parked %s", gen.path)
            await self._retry(gen)

    async def _retry(self, gen: FileGen) -> None:
        """Try a parked generation again, where the replica holds it."""
        self.parked.discard(gen)
        gen.move(State.FAILED)
        if gen.staged is None:
            self.e.upload_again(gen)
            return
        outer, self.current = self.current, gen  # its failures count on it, not on the op being applied
        try:
            for path, node in self.replica.nodes_of(gen.ino):
                if isinstance(node, File) and node.held is gen:
                    await self._materialize(path, node)
        except GiveUp:
            pass  # parked again
        finally:
            self.current = outer

    async def _retry_moved(self, dst: str) -> None:
        """Parked files a rename moved (to `dst` or under it) are tried again
        now, not at the next retry of parked files: the user may have moved
        one out of the way of what the store cannot take."""
        moved = [g for g in self.parked if g.state is State.PARKED and not g.lost
                 and any(p == dst or p.startswith(dst + "/") for p, n in self.replica.nodes_of(g.ino) if isinstance(n, File) and n.held is g)]
        for gen in moved:
            log.info("retrying parked %s: moved to %s", gen.path, dst)
            await self._retry(gen)

    async def forget_parked(self) -> None:
        """At a clean exit, the records of files the store never showed:
        parked ones, and parked ones deleted since, whose removal waits. A
        try writes a file's record before its bytes, and the store refused
        the bytes for good: the record vouches for nothing, and would have
        `verify` call the file missing and the next mount warn of a loss.
        No parked file is tried again from here on."""
        self.retry_parked_at = math.inf
        files = [(p, n) for g in self.parked if g.state is State.PARKED for p, n in self.replica.nodes_of(g.ino)
                 if isinstance(n, File) and n.held is g]
        files += [(self.replica.path_of(n), n) for n, op in self.deferred if isinstance(op, Remove) and isinstance(n, File)]
        files = [(path, node) for path, node in files
                 if path is not None and node.shown is None and node.held is not None and node.held.tries
                 # an abandoned try may still land there (and the exit must not wait for a hung store)
                 and not any(not x.ended.is_set() and _overlap(x.at, (path,)) for x in self.late)]
        for i, (path, node) in enumerate(files):
            try:
                record = await self.e.calls.run(f"record {path}", manifest.read, self.e.backend, path)
                # Only the record this generation's try wrote, and keeping no earlier digest:
                # else the store may still show other bytes there that it vouches for (a
                # file renamed over published ones, then parked).
                if record is not None and record.current == node.held.digest and record.previous is None:
                    await self._fenced(f"record {path}", manifest.delete, self.e.backend, path, at=(path,))
            except Exception as exc:  # the store fails: one deadline, not one per file, before the exit
                log.warning("cannot remove the record of %s, never published (%s): it and %d more stay", path, exc, len(files) - i - 1)
                return

    # -- what the store shows ----------------------------------------------------------
    def shown(self, ino: int) -> tuple[str, Shown] | None:
        """A path where the store shows `ino`'s newest published bytes."""
        return shown_digest(self.replica, ino)

    def settled_before_join(self, seq: int) -> bool:
        """Cluster mode: the op `seq` was applied to the store before this
        node joined (only a `Following` publisher joins a running cluster)."""
        return False

    def held_at_join(self, ino: int, generation: int) -> tuple[int, str, str] | None:
        """Cluster mode: (seq, owner, error) of a generation the publishing
        node had held or parked (error) when this node joined; None if not."""
        return None

    def showed(self, ino: int, generation: int, path: str, digest) -> None:
        """Cluster mode: the publishing node showed `generation` of `ino` at
        `path` (heard by the nodes that follow it; see `Following`)."""

    def heard(self, ino: int, generation: int) -> Digest | None:
        """Cluster mode: the digest of `generation` of `ino` that the
        publishing node said it showed (None: not heard, or this node publishes)."""
        return None

    # -- restart ----------------------------------------------------------------
    def restored(self, path: str, node: Node) -> None:
        self.replica.bind(path, node)
        if isinstance(node, Dir):
            node.made = True

    def restored_files(self, parent: str, files: list[tuple[str, File]]) -> None:
        """`restored` of many files of directory `parent`: (name, node) each."""
        d = self.replica.directory(parent)
        for name, node in files:
            self.replica.bind_in(d, name, node)


def shown_digest(replica: Replica, ino: int) -> tuple[str, Shown] | None:
    """A path where the store shows `ino`'s newest published bytes."""
    best = None
    for path, node in replica.nodes_of(ino):
        if (isinstance(node, File) and node.shown is not None and node.shown.ino == ino
                and (best is None or node.shown.generation > best[1].generation)):
            best = (path, node.shown)
    return best


def _shown(node: File, gen: FileGen) -> None:
    """`gen` has just been published at `node`'s name."""
    node.shown = Shown(gen.ino, gen.generation, gen.digest, gen.meta)
    node.held = None
    if gen.staged is not None and gen.staged.token is not None:
        gen.staged = None  # consumed: the staging object is now the file


def _gone_at(gen: FileGen) -> int:
    """A settled generation: the journal position from which the store may
    lack its bytes. Published: none (its seal). Replaced by a newer
    generation of its file: that one's seal. Deleted before its turn: the
    op that deleted it."""
    if gen.state is State.DROPPED:
        if gen.superseded_by is not None:
            return gen.superseded_by.seq
        return max(gen.seq, gen.dropped_by)
    return gen.seq


def _under(top: str, rel: str) -> str:
    """The path of `rel` in directory `top` (`rel` empty: `top` itself)."""
    return f"{top}/{rel}" if rel else top
