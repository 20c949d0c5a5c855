"""The publisher of a cluster node that does not publish.

In cluster mode every node's engine holds the same journal (the cluster
log's seals and changes, in its order, with the same sequence numbers), but
one node's `Publisher` applies it to the store. Every other node runs a
`Following` publisher: it never touches the store; it completes each op of
its journal once the publishing node reports it applied (`progress`), and
learns where files were shown (`showed`) so that reads load them.

The publishing node holds a removal back until the files sealed before it
settle (a parked or lost file: for good). Its progress then names two
points: its `position`, just before the first removal held back; and how
far it `applied` everything else. Ops between the two are done here as
there (barriers, loads and flushes do not wait for them) but stay queued
until the position passes them: a node taking over applies the journal
from `applied` on, and holds those removals back again. Its own
generations are staged by its upload workers and reported to the publishing
node (`ClusterLink.staged`); they are published when that node says so.
"""

from __future__ import annotations

import bisect
import itertools

from .heldback import HeldBack
from .journal import FileGen, Op, Remove
from .manifest import Digest, Meta
from .publisher import Publisher
from .replica import Shown
from .state import State


class Following(Publisher):
    follows = True

    def __init__(self, engine, markers) -> None:
        super().__init__(engine, markers)
        self.leader_position = 0  # the publishing node applied every op up to this sequence number
        self.leader_applied = 0  # and every op up to this one but the removals it holds back
        self.waiting = HeldBack()  # those removals
        self._looked_at = 0  # ops up to this sequence number were done beyond the position, or held back
        self._held_back: dict[int, Op] = {}  # ops beyond the position that the publishing node holds back
        self.joined_at = 0  # where it was when this node joined (every generation up to there had its turn)
        self._held: dict[tuple[int, int], tuple[int, str, str]] = {}  # what it held or parked then: (ino, generation) -> (seq, owner, error)
        self._digests: dict[int, tuple[int, Digest | None]] = {}  # inode -> (generation, digest) the publishing node showed

    async def run(self) -> None:
        e = self.e
        while True:
            if e.publisher is not self:
                # Replaced (this node took over publishing) after a change woke it: the
                # cancellation comes at its next checkpoint, and what is queued now is
                # the new publisher's (the gone node's held generations, due again).
                return
            while e.queue and self._applied(e.queue[0]):
                self._complete(e.queue[0])
            if self._done_beyond():
                e.notify()
            await e.wait_change()

    def _applied(self, op: Op) -> bool:
        """The publishing node has had `op`'s turn: done, or for a file,
        published, held (a marker that waits for a parked file) or parked:
        a file that is not published stays unsettled here as there."""
        return op.seq <= self.leader_position

    def _done_beyond(self) -> bool:
        """Complete the namespace ops the publishing node applied beyond its
        position (its files' generations settle as it shows them); True if any."""
        done = [op for seq, op in self._held_back.items() if seq not in self.waiting]
        for op in done:
            del self._held_back[op.seq]
            op.done.set()
        if self.leader_applied <= self._looked_at:
            return bool(done)
        queue = self.e.queue
        # The first op not looked at yet: the queue is in journal order. A bisection, not a walk from either
        # end: while a removal is held back, the ops before it pile up at the front, the ops the publishing
        # node has not applied yet at the back, and this runs at every change of the engine.
        start = bisect.bisect_right(queue, self._looked_at, key=lambda op: op.seq)
        for op in itertools.islice(queue, start, None):
            if op.seq > self.leader_applied:
                break
            self._looked_at = op.seq
            if isinstance(op, FileGen):
                continue
            if isinstance(op, Remove) and op.seq in self.waiting:
                self._held_back[op.seq] = op
            else:
                op.done.set()
                done.append(op)
        else:  # every op up to `applied` may not have reached this node's journal yet
            return bool(done)
        self._looked_at = self.leader_applied  # an op after it is queued: all before it are here
        return bool(done)

    def settled(self, gen: FileGen) -> bool:
        if super().settled(gen):
            return True
        # dropped by an op the publishing node applied beyond its position (a newer seal, a removal not held back)
        return (gen.state is State.DROPPED and gen.superseded_by is None and gen.dropped_by <= self.leader_applied
                and not self._held_removal(gen.dropped_by))

    def _held_removal(self, seq: int) -> bool:
        """Whether op `seq` is a removal the publishing node holds back (the
        ranges of `waiting` say so of removals only; an op no longer queued
        counts as one, as before ranges)."""
        if seq not in self.waiting:
            return False
        queue = self.e.queue
        i = bisect.bisect_left(queue, seq, key=lambda op: op.seq)
        return i == len(queue) or queue[i].seq != seq or isinstance(queue[i], Remove)

    def joined(self, position: int, held: list[list], applied: int, waiting: list[list[int]]) -> None:
        """This node joined a running cluster whose publishing node had
        applied every op up to `position`, and up to `applied` all but the
        removals `waiting`: the generations up to there were published long
        ago, but for those it `held` or parked then (rows of seq, inode,
        generation, owner, error)."""
        self.joined_at = max(position, applied)
        self._held = {(ino, generation): (seq, owner, error) for seq, ino, generation, owner, error in held}
        self.progress(position, applied, waiting)

    def settled_before_join(self, seq: int) -> bool:
        return seq <= self.joined_at

    def held_at_join(self, ino: int, generation: int) -> tuple[int, str, str] | None:
        return self._held.get((ino, generation))

    def progress(self, position: int, applied: int | None = None, waiting: list[list[int]] = ()) -> None:
        """The publishing node applied every op up to `position`, and up to
        `applied` every op but the removals `waiting` (ranges: `HeldBack`)."""
        applied = position if applied is None else applied
        held = HeldBack(waiting)
        if position > self.leader_position or applied != self.leader_applied or held != self.waiting:
            self.leader_position = max(position, self.leader_position)
            self.leader_applied, self.waiting = applied, held
            self.e.notify()

    def shown(self, ino: int) -> tuple[str, Shown] | None:
        """Where the store shows `ino` now (its path in the mount: the
        caller waits for the publishing node to apply what came before),
        with its digest if this node heard it; without, the store's record
        vouches for the bytes (read at load)."""
        paths = self.e.ns.paths_of(ino)
        if not paths:
            return None
        generation = self.e.published_gen.get(ino, 0)
        return paths[0], Shown(ino, generation, self.heard(ino, generation), Meta())

    def heard(self, ino: int, generation: int) -> Digest | None:
        """The digest of `generation` of `ino` that the publishing node said it showed (None: not heard)."""
        heard = self._digests.get(ino)
        return heard[1] if heard is not None and heard[0] == generation else None

    def showed(self, ino: int, generation: int, path: str, digest: Digest | None) -> None:
        old = self._digests.get(ino)
        if old is None or old[0] <= generation:
            self._digests[ino] = (generation, digest)
