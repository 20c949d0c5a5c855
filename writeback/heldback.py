"""The removals a cluster's publishing node holds back, as its progress
reports name them: runs of journal sequence numbers.

The publishing node holds a removal back until the files sealed before it
settle, and once one is held back, every later removal waits behind it but
for those it has no need to wait for (nothing of theirs in the store) and
those it applies early (their names taken again: `Publisher._clear_way`).
Behind a parked file that can be thousands of removals (every rotation of
old checkpoints), so a report names them as ranges `[first, last]`: every
removal whose sequence number lies in one is held back, and a range ends
before each removal that had its turn and is not held back (`of`). Ops of
other kinds inside a range are not removals: the ranges say nothing of
them. A progress event lists at most `cap` ranges (`cut`); the progress
Redis keeps beside the events lists them all (see `cluster.events`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


class HeldBack:
    """Ranges `[first, last]` of removals held back, sorted and disjoint."""

    __slots__ = ("_firsts", "ranges")

    def __init__(self, ranges: Iterable[Iterable[int] | int] = ()) -> None:
        # A bare number: one removal (how reports named them before ranges)
        self.ranges = [(r, r) if isinstance(r, int) else (int(r[0]), int(r[1])) for r in ranges]  # type: ignore[index]
        self._firsts = [first for first, _ in self.ranges]

    @classmethod
    def of(cls, held: Iterable[int], not_held: list[int]) -> HeldBack:
        """`held`: the removals held back, ascending; `not_held`: removals
        after the first of them that had their turn and are not held back
        (ascending): each ends a range."""
        ranges: list[list[int]] = []
        i = 0
        for seq in held:
            split = False
            while i < len(not_held) and not_held[i] < seq:
                split = split or (bool(ranges) and not_held[i] > ranges[-1][1])
                i += 1
            if ranges and not split:
                ranges[-1][1] = seq
            else:
                ranges.append([seq, seq])
        return cls(ranges)

    def __contains__(self, seq: object) -> bool:
        """Whether the removal `seq` is held back (ask of removals only)."""
        if not isinstance(seq, int):
            return False
        i = bisect.bisect_right(self._firsts, seq) - 1
        return i >= 0 and seq <= self.ranges[i][1]

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def __len__(self) -> int:
        return len(self.ranges)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HeldBack) and self.ranges == other.ranges

    def __repr__(self) -> str:
        return f"HeldBack({self.ranges})"

    @property
    def first(self) -> int:
        return self.ranges[0][0]

    def cut(self, cap: int) -> tuple[HeldBack, int | None]:
        """At most `cap` ranges, and the first removal left out (None: none)."""
        if len(self.ranges) <= cap:
            return self, None
        return HeldBack(self.ranges[:cap]), self.ranges[cap][0]

    def rows(self) -> list[list[int]]:
        return [[first, last] for first, last in self.ranges]
