"""The publisher of a cluster node that does not publish.

In cluster mode every node's engine holds the same journal (the cluster
log's seals and changes, in its order, with the same sequence numbers), but
one node's `Publisher` applies it to the store. Every other node runs a
`Following` publisher: it never touches the store; it completes each op of
its journal once the publishing node reports it applied (`progress`), and
learns where files were shown (`showed`) so that reads load them. Its own
generations are staged by its upload workers and reported to the publishing
node (`ClusterLink.staged`); they are published when that node says so.
"""

from __future__ import annotations

from .journal import Op
from .manifest import Digest, Meta
from .publisher import Publisher
from .replica import Shown


class Following(Publisher):
    def __init__(self, engine, markers) -> None:
        super().__init__(engine, markers)
        self.leader_position = 0  # the publishing node applied every op up to this sequence number
        self.joined_at = 0  # where it was when this node joined
        self._held: dict[tuple[int, int], tuple[int, str, str]] = {}  # what it held or parked then: (ino, generation) -> (seq, owner, error)
        self._digests: dict[int, tuple[int, Digest | None]] = {}  # inode -> (generation, digest) the publishing node showed

    async def run(self) -> None:
        e = self.e
        while True:
            while e.queue and self._applied(e.queue[0]):
                self._complete(e.queue[0])
            await e.wait_change()

    def _applied(self, op: Op) -> bool:
        """The publishing node has had `op`'s turn: done, or for a file,
        published, held (a marker that waits for a parked file) or parked:
        a file that is not published stays unsettled here as there."""
        return op.seq <= self.leader_position

    def joined(self, position: int, held: list[list]) -> None:
        """This node joined a running cluster whose publishing node had
        applied every op up to `position`: the generations up to there were
        published long ago, but for those it `held` or parked then (rows of
        seq, inode, generation, owner, error)."""
        self.joined_at = position
        self._held = {(ino, generation): (seq, owner, error) for seq, ino, generation, owner, error in held}
        self.progress(position)

    def settled_before_join(self, seq: int) -> bool:
        return seq <= self.joined_at

    def held_at_join(self, ino: int, generation: int) -> tuple[int, str, str] | None:
        return self._held.get((ino, generation))

    def progress(self, position: int) -> None:
        """The publishing node applied every op up to `position`."""
        if position > self.leader_position:
            self.leader_position = position
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
        heard = self._digests.get(ino)
        digest = heard[1] if heard is not None and heard[0] == generation else None
        return paths[0], Shown(ino, generation, digest, Meta())

    def showed(self, ino: int, generation: int, path: str, digest: Digest | None) -> None:
        old = self._digests.get(ino)
        if old is None or old[0] <= generation:
            self._digests[ino] = (generation, digest)
