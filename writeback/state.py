"""The life of one sealed generation of a file, and the only way to change it.

    DIRTY ──> UPLOADING ──> STAGED ──> PUBLISHED
                 │  ^          │
                 v  │          v
                FAILED <───────┘      (transient errors: retried with backoff, forever)
                 │  ^
                 v  │
                PARKED                (permanent errors, after a few tries: retried
                                       rarely; it no longer blocks the queue)

    any state but PUBLISHED ──> DROPPED   (superseded by a newer generation,
                                           or deleted before publication)
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    DIRTY = "dirty"  # sealed, waiting for an upload worker
    UPLOADING = "uploading"  # being hashed and staged in the store
    STAGED = "staged"  # in the store, invisible, waiting for its turn
    PUBLISHED = "published"  # visible in the store, recorded in the manifest
    FAILED = "failed"  # the last attempt failed; retrying
    PARKED = "parked"  # failed permanently (e.g. a name the store cannot take); retried rarely
    DROPPED = "dropped"  # never to be published (superseded or deleted)


_MOVES = {
    State.DIRTY: {State.UPLOADING, State.DROPPED},
    State.UPLOADING: {State.STAGED, State.FAILED, State.PARKED, State.DROPPED},
    State.STAGED: {State.PUBLISHED, State.FAILED, State.PARKED, State.DROPPED},
    State.FAILED: {State.UPLOADING, State.STAGED, State.PUBLISHED, State.PARKED, State.DROPPED},
    State.PARKED: {State.FAILED, State.DROPPED},
    State.PUBLISHED: set(),
    State.DROPPED: set(),
}


class IllegalTransition(Exception):
    pass


def transition(current: State, new: State) -> State:
    if new is current and new is State.FAILED:
        return new  # failing again while failed
    if new not in _MOVES[current]:
        raise IllegalTransition(f"{current.value} -> {new.value}")
    return new
