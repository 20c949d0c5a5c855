"""The journal: what happened on the mount, as ops in one sequence.

The inode tree (fs/) reports seals and namespace changes as they happen; each
becomes an `Op` with the next sequence number. The publisher applies them in
that order (C3). Paths are relative to the mount's root, as of the event.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import trio

from .backend import Staged
from .manifest import Digest, Meta
from .state import State, transition
from .storeio import Cancelled


class Snapshot(Protocol):
    size: int

    def pieces(self): ...
    def release(self) -> None: ...


LOST = "lost: "  # the error of a lost generation (cluster mode), before why


@dataclass(eq=False)
class Op:
    seq: int
    done: trio.Event = field(default_factory=trio.Event, init=False)
    tries: int = field(default=0, init=False)
    error: str = field(default="", init=False)  # of its last failed step
    error_at: float = field(default=0.0, init=False)  # when (time.time())
    logged_at: float = field(default=0.0, init=False)  # when a retry of it was last logged (time.monotonic())
    # A generation its application sealed again (`Publisher._keep_copies`):
    # the op is not applied, for a flush, until that one is published.
    resealed: FileGen | None = field(default=None, init=False)

    @property
    def path(self) -> str:  # for humans: logs, status, flush
        return ""


@dataclass(eq=False)
class FileGen(Op):
    """One sealed generation of a file on its way to the store."""

    ino: int
    generation: int
    snapshot: Snapshot | None
    meta: Meta  # mode, owner and mtime when it was sealed
    size: int
    names: list[str]  # the file's paths when it was sealed
    state: State = State.DIRTY
    digest: Digest | None = None
    staged: Staged | None = None
    sealed_at: float = field(default_factory=time.time)
    attempt: int = 0  # bumped per staging attempt: a late, abandoned attempt sees it changed and stops
    readers: int = 0  # threads reading the snapshot (abandoned ones included)
    publishing: bool = False  # the publisher is showing it: it can no longer be dropped
    dropped_by: int = 0  # the seq of the op that deleted the file, if that dropped it
    superseded_by: FileGen | None = None
    retry_at: float = 0.0  # trio time before which a failed step is not retried
    owner: str | None = None  # cluster mode: the node whose RAM holds it (None: this one), which stages it
    hidden: bool = False  # cluster mode: staged again under a hidden key, never at a name (`Publisher._staged_again`)
    shown_at: str = ""  # the name it was first shown at (published there: by this node, or by the publishing node, which said so)
    tried: set[str] = field(default_factory=set)  # store paths where a try to show it failed, and may have landed all the same
    # Called after each change of `state` (by the engine: `status` counts
    # the file again, and needs to look at no generation that did not change).
    on_state: Callable[[FileGen], None] | None = field(default=None, repr=False)

    @property
    def path(self) -> str:
        return self.names[0] if self.names else ""

    @property
    def lost(self) -> bool:
        """Cluster mode: parked for good, its bytes gone with the node that held them."""
        return self.state is State.PARKED and self.error.startswith(LOST)

    def pieces(self):
        """The sealed bytes, read lazily (in a store call's thread); Cancelled
        once the snapshot is let go (the generation was dropped)."""
        snapshot = self.snapshot
        if snapshot is None:
            raise Cancelled()
        yield from snapshot.pieces()

    def move(self, new: State) -> None:
        self.state = transition(self.state, new)
        if self.on_state is not None:
            self.on_state(self)

    @property
    def settled(self) -> bool:
        """Nothing more will happen to it: published, or dropped for good."""
        if self.state is State.PUBLISHED:
            return True
        if self.state is State.DROPPED:
            return self.superseded_by is None or self.superseded_by.settled
        return False


@dataclass(eq=False)
class Rename(Op):
    src: str
    dst: str
    ino: int
    is_dir: bool
    replaced: int = 0  # the inode it replaced at dst (0: none)

    @property
    def path(self) -> str:
        return self.src


@dataclass(eq=False)
class Exchange(Op):
    a: str
    b: str

    @property
    def path(self) -> str:
        return self.a


@dataclass(eq=False)
class Named(Op):
    """An op on one name."""

    name: str
    ino: int

    @property
    def path(self) -> str:
        return self.name


@dataclass(eq=False)
class Link(Named):
    pass


@dataclass(eq=False)
class Remove(Named):
    is_dir: bool


@dataclass(eq=False)
class Mkdir(Named):
    pass


@dataclass(eq=False)
class Symlink(Named):
    target: str
    meta: Meta


@dataclass(eq=False)
class Attrs(Op):
    """An inode's mode, owner or mtime was set (chmod, chown, utime)."""

    ino: int
    meta: Meta


NameOp = Rename | Exchange | Link | Remove | Mkdir | Symlink | Attrs


def kind(op: Op) -> str:
    return type(op).__name__.lower()
