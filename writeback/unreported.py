"""What the cluster's publishing node changed in the store since its
progress last reached the other nodes.

A node taking over publishing applies the journal again from the last
progress it heard (see `takeover`): the gone node may have applied a few
ops after it. Each such op applied again alone is harmless: what it moved
or removed is gone from where it was, what it wrote is written again. Two
of them on the same path are not, once the later one is applied too:

- `rename d -> b`, then `rename e -> d`: applied again, the first moves
  `e`'s bytes (at `d` by then) over `b`, whose bytes are lost there;
- a file removed, then a new one at its name: the removal, applied again,
  deletes the new file;
- an attribute change, then a newer generation's record: applied again,
  the change puts the old attributes on the new bytes.

So the publishing node changes no store path that an op not yet reported
changed (or, for ops that move what is there, a path above or below one)
before its progress, taken after that op, reached the other nodes
(`ClusterLink.reported`). The ops applied between two reports then touch
unrelated paths, and applying them again is harmless.

Progress reports are numbered: a change noted while `made` reports were
made is covered once report `made + 1` is sent.
"""

from __future__ import annotations

from .journal import Exchange, FileGen, Op, Rename

MOVES = (Rename, Exchange, FileGen)  # ops whose store steps follow a path: what is below or above it counts too
PRUNE_AT = 4096  # entries kept before the covered ones are dropped (then twice as many as were left)


def _above(path: str) -> list[str]:
    """The directories above `path` (the root not counted)."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


class Unreported:
    def __init__(self) -> None:
        self._moved: dict[str, tuple[int, Op | None]] = {}  # path -> (report number when changed, by which op; None: several)
        self._below: dict[str, tuple[int, Op | None]] = {}  # a directory -> the same, for a path under it that `_moved` holds
        self._named: dict[str, tuple[int, Op | None]] = {}  # paths that other ops changed (exactly there)
        self._prune_at = PRUNE_AT

    def note(self, paths: tuple[str, ...] | list[str], op: Op, made: int, sent: int) -> None:
        """`op` changed `paths` in the store while `made` progress reports
        were made, `sent` of them sent."""
        moves = isinstance(op, MOVES)
        for path in paths:
            if not path:
                continue
            if moves:
                _merge(self._moved, path, op, made, sent)
                for above in _above(path):
                    _merge(self._below, above, op, made, sent)
            else:
                _merge(self._named, path, op, made, sent)
        if len(self._moved) + len(self._named) > self._prune_at:
            self._prune(sent)

    def conflicts(self, paths: tuple[str, ...] | list[str], op: Op, sent: int) -> bool:
        """Whether `op` changing `paths` must wait for a report first."""
        def other(entry: tuple[int, Op | None] | None) -> bool:
            return entry is not None and entry[0] >= sent and entry[1] is not op

        for path in paths:
            if other(self._moved.get(path)) or other(self._named.get(path)) or other(self._below.get(path)):
                return True
            if any(other(self._moved.get(above)) for above in _above(path)):
                return True
        return False

    def clear(self) -> None:
        """A report taken after every change noted so far was sent."""
        self._moved.clear()
        self._below.clear()
        self._named.clear()

    def _prune(self, sent: int) -> None:
        for d in (self._moved, self._below, self._named):
            for path in [p for p, (made, _) in d.items() if made < sent]:
                del d[path]
        self._prune_at = max(PRUNE_AT, 2 * (len(self._moved) + len(self._named)))


def _merge(d: dict[str, tuple[int, Op | None]], path: str, op: Op, made: int, sent: int) -> None:
    old = d.get(path)
    several = old is not None and old[0] >= sent and old[1] is not op
    d[path] = (made, None if several else op)
