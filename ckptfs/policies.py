"""When to save and which checkpoints to keep, for `CheckpointManager`.

The vocabulary follows Orbax: *save decision* policies answer "save at this
step?"; *preservation* policies answer "which of these checkpoints stay?".
Both are small objects; any object with the same method works as a
user-defined policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Checkpoint:
    step: int
    time: float  # when it was saved (the commit marker's time)
    path: str
    published: bool  # in the store (complete checkpoints only are listed)


@dataclass
class SaveContext:
    """What a save policy may ask about the checkpoints so far."""

    last_step: int | None
    last_time: float | None
    previous_published: Callable[[], bool]  # asks the daemon; True when nothing is in flight
    now: float = field(default_factory=time.time)


class SavePolicy(Protocol):
    def should_save(self, step: int, ctx: SaveContext) -> bool: ...


class PreservationPolicy(Protocol):
    def keep(self, checkpoints: list[Checkpoint]) -> set[int]: ...


# -- save decisions ---------------------------------------------------------------
@dataclass(frozen=True)
class EveryNSteps:
    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("EveryNSteps: n must be at least 1")

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        return step % self.n == 0 and step != ctx.last_step


@dataclass(frozen=True)
class EveryNSeconds:
    seconds: float

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        return ctx.last_time is None or ctx.now - ctx.last_time >= self.seconds


@dataclass(frozen=True)
class ContinuousCheckpointing:
    """Save as soon as the previous checkpoint is published (never two in
    flight), at most every `minimum_interval_secs`."""

    minimum_interval_secs: float = 0.0

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        if step == ctx.last_step:
            return False
        if ctx.last_time is not None and ctx.now - ctx.last_time < self.minimum_interval_secs:
            return False
        return ctx.previous_published()


@dataclass(frozen=True)
class AnySavePolicy:
    """Save when any of the policies says so."""

    policies: tuple[SavePolicy, ...]

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        return any(p.should_save(step, ctx) for p in self.policies)


# -- preservation -----------------------------------------------------------------
@dataclass(frozen=True)
class LatestN:
    n: int

    def keep(self, checkpoints: list[Checkpoint]) -> set[int]:
        return {c.step for c in sorted(checkpoints, key=lambda c: c.step)[-self.n:]} if self.n > 0 else set()


@dataclass(frozen=True)
class KeepEveryNSeconds:
    """Keep one checkpoint per window of `seconds` (the first in each)."""

    seconds: float

    def keep(self, checkpoints: list[Checkpoint]) -> set[int]:
        kept, windows = set(), set()
        for c in sorted(checkpoints, key=lambda c: c.step):
            w = int(c.time // self.seconds)
            if w not in windows:
                windows.add(w)
                kept.add(c.step)
        return kept


@dataclass(frozen=True)
class KeepEveryNSteps:
    n: int

    def keep(self, checkpoints: list[Checkpoint]) -> set[int]:
        return {c.step for c in checkpoints if c.step % self.n == 0}


@dataclass(frozen=True)
class AnyPreservation:
    """Keep what any of the policies keeps (compose: LatestN(3) + one per hour)."""

    policies: tuple[PreservationPolicy, ...]

    def keep(self, checkpoints: list[Checkpoint]) -> set[int]:
        out: set[int] = set()
        for p in self.policies:
            out |= p.keep(checkpoints)
        return out


@dataclass(frozen=True)
class CustomPreservation:
    """A user-defined rule: `fn(checkpoints) -> steps to keep`."""

    fn: Callable[[list[Checkpoint]], Iterable[int]]

    def keep(self, checkpoints: list[Checkpoint]) -> set[int]:
        return set(self.fn(checkpoints))


@dataclass(frozen=True)
class KeepAll:
    def keep(self, checkpoints: list[Checkpoint]) -> set[int]:
        return {c.step for c in checkpoints}


def any_of(*policies):
    """Compose save policies (save if any says so) or preservation policies
    (keep what any keeps)."""
    if all(hasattr(p, "keep") for p in policies):
        return AnyPreservation(tuple(policies))
    if all(hasattr(p, "should_save") for p in policies):
        return AnySavePolicy(tuple(policies))
    raise TypeError("any_of: mix of save and preservation policies")
