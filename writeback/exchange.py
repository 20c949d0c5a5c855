"""An exchange (renameat2 RENAME_EXCHANGE) as the store applies it: a plan
of idempotent steps in phases, kept in the store while it runs.

On an object store an exchange is many calls (every file of both sides
moves through a hidden name); on a local store, one rename(2) and the
record changes around it. A crash, or a cluster's publishing node dying,
can cut it short anywhere. Applying it again from the start is wrong (an
exchange applied twice is undone), and so is leaving it halfway (files
of both sides at one name, records naming the other side's bytes). So
the publisher writes the plan to the store (`PLAN`) before its first
step, and again as each phase ends. Each phase's steps can be done again
as long as the next phase has not begun, so whoever finds a plan not done
finishes it from the phase it names:

- a restart's scan, before it lists the store (`finish`);
- a node taking over publishing for a cluster, by the same scan: the plan
  also tells it that the gone node applied every change of the journal up
  to this exchange (`Plan.seq`; it applies them in order), though the
  last progress it reported may be older. Changes it applies again are
  only those after it, each of them idempotent.

One plan at a time, so one object: the next exchange replaces it. A
publisher starting afresh (not taking over) removes it after its scan:
the journal positions it names mean nothing to a new journal.

Phases: (1) the records first, each naming what its path may hold until
the move, and on an object store every file copied to its hidden name;
(2) the originals deleted and the directory side's folder keys with them
(object store), or the entries swapped or moved (local store); (3) each
hidden copy moved to its new path, the final records, the old paths'
records removed.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import manifest
from .backend import META, STAGING
from .manifest import Digest, Meta, Record
from .replica import Shown

if TYPE_CHECKING:
    from .backend import Backend

log = logging.getLogger(__name__)

PLAN = f"{META}/exchange"
PHASES = 3


@dataclass
class Plan:
    seq: int  # the journal position of the exchange
    what: str  # "a and b", for the log
    phases: list[list[list]] = field(default_factory=lambda: [[] for _ in range(PHASES)])  # steps: [kind, *args], JSON
    done: int = 0  # phases done
    # One thread at a time applies it: a try abandoned at its deadline goes
    # on in its thread, and the next try must not run another phase beside it
    # (a phase's steps may be done again only before the next phase begins).
    applying: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, phase: int, rec: Record) -> None:
        self.phases[phase].append(["record", json.loads(rec.encode())])

    def encode(self) -> bytes:
        return json.dumps({"seq": self.seq, "what": self.what, "phases": self.phases, "done": self.done}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Plan:
        d = json.loads(raw)
        plan = cls(int(d["seq"]), str(d["what"]), [list(p) for p in d["phases"]], int(d["done"]))
        if len(plan.phases) != PHASES or not 0 <= plan.done <= PHASES:
            raise ValueError("not an exchange plan")
        for steps in plan.phases:
            for step in steps:
                _check(step)
        return plan


_PATHS = {"rmdirs": (), "unrecord": (1,), "copy": (1, 2), "delete": (1,), "delete-file": (1,), "move": (1, 2), "swap": (1, 2), "move-tree": (1, 2),
          "mkdir": (1,)}


def _check(step: list) -> None:
    """A plan in the store is input: its steps change the mount's paths
    only, and bytes come from or go to a hidden name only where an exchange
    on an object store puts them (a copy's destination, a move's source)."""
    kind = step[0]
    if kind == "record":
        Record.of_dict(step[1])
        return
    if kind not in _PATHS:
        raise ValueError(f"unknown step {kind!r}")
    for i in _PATHS[kind]:
        path = step[i]
        hidden_ok = (kind, i) in (("copy", 2), ("move", 1))
        if not isinstance(path, str) or not (_hidden(path) if hidden_ok and path.startswith(META + "/") else _mount_path(path)):
            raise ValueError(f"a {kind} step names {path!r}")
    if kind == "move":
        _digest(step[3])
    elif kind == "delete-file":
        if _digest(step[2]) is None or not all(v is None or isinstance(v, int) for v in step[3]):
            raise ValueError("a delete-file step names no digest, or no meta")
        Meta(*step[3])
    elif kind == "move-tree":
        for rel, d in step[3]:
            if rel and not _mount_path(rel):
                raise ValueError(f"a move-tree step names {rel!r}")
            _digest(d)
    elif kind == "rmdirs":
        if not all(isinstance(p, str) and _mount_path(p) for p in step[1]):
            raise ValueError(f"a rmdirs step names {step[1]!r}")
    elif kind == "swap" and step[3] is not None:
        [None if i is None else tuple(int(n) for n in i) for i in step[3]]


def _mount_path(path: str) -> bool:
    from .storeio import nameable  # a cycle: storeio's scan finishes plans

    return bool(path) and path.split("/")[0] != META and nameable(path)


def _hidden(path: str) -> bool:
    """A name `Backend.hidden_name` gives."""
    parts = path.split("/")
    return path.startswith(STAGING + "/") and len(parts) == 4 and all(p not in ("", ".", "..") for p in parts)


def _digest(d: dict | None) -> Digest | None:
    return None if d is None else manifest.digest_of_dict(d)


def digest_arg(d: Digest | None) -> dict | None:
    return None if d is None else manifest.digest_dict(d)


def begin(backend: Backend, plan: Plan) -> None:
    """Keep `plan` in the store, then apply it. A swap's step is given the
    identities of both entries first: done again, it sees whether the
    entries were swapped already."""
    with plan.applying:
        for steps in plan.phases:
            for step in steps:
                if step[0] == "swap" and step[3] is None:
                    step[3] = [_identity(backend, step[1]), _identity(backend, step[2])]
        backend.put(PLAN, plan.encode())
        _apply(backend, plan)


def _identity(backend: Backend, path: str) -> list | None:
    found = backend.identity(path)
    return None if found is None else list(found)  # type: ignore[call-overload]


def run(backend: Backend, plan: Plan) -> None:
    """Apply what is left of `plan`, a phase at a time, each kept as done in
    the store before the next begins. Tried again after a failure, from the
    phase it failed in."""
    with plan.applying:
        _apply(backend, plan)


def _apply(backend: Backend, plan: Plan) -> None:
    from . import storeio  # a cycle: storeio's scan finishes plans

    while plan.done < PHASES:
        for step in plan.phases[plan.done]:
            kind, args = step[0], step[1:]
            if kind == "record":
                manifest.write(backend, Record.of_dict(args[0]))
            elif kind == "unrecord":
                manifest.delete(backend, args[0])
            elif kind == "copy":
                backend.copy(args[0], args[1])
            elif kind == "delete":
                backend.delete(args[0])
            elif kind == "delete-file":  # its record too, marked as being deleted first (`storeio.delete`)
                storeio.delete(backend, args[0], Shown(0, 0, _digest(args[1]), Meta(*args[2])))
            elif kind == "move":
                storeio.move(backend, args[0], args[1], _digest(args[2]))
            elif kind == "swap":
                storeio.swap(backend, args[0], args[1], [tuple(tuple(i) if i is not None else None for i in args[2])])
            elif kind == "move-tree":  # a local store's directory, whole if it can, else file by file
                old, new, files = args
                if not backend.move_dir(old, new):
                    for rel, d in files:
                        storeio.move(backend, f"{old}/{rel}" if rel else old, f"{new}/{rel}" if rel else new, _digest(d))
            elif kind == "mkdir":
                backend.mkdir(args[0])
            elif kind == "rmdirs":
                backend.rmdirs(args[0])
            else:
                raise ValueError(f"unknown step {kind!r} in the exchange plan")
        plan.done += 1
        backend.put(PLAN, plan.encode())


def read(backend: Backend) -> Plan | None:
    try:
        raw = backend.read_all(PLAN)
    except FileNotFoundError:
        return None
    try:
        return Plan.decode(raw)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
        log.warning("ignoring %s: not an exchange plan ckptfs wrote (%s)", PLAN, exc)
        return None


def finish(backend: Backend) -> int:
    """Finish an exchange a crash cut short (a restart's scan, a takeover);
    the journal position of the last exchange the store applied (0: none
    kept)."""
    plan = read(backend)
    if plan is None:
        return 0
    if plan.done < PHASES:
        log.info("finishing the exchange of %s that a crash cut short (phase %d of %d)", plan.what, plan.done + 1, PHASES)
        try:
            run(backend, plan)
        except FileNotFoundError as exc:  # what it moves is gone: changed since without ckptfs
            log.warning("cannot finish the exchange of %s (%s): the store keeps what it holds, and the plan goes", plan.what, exc)
            backend.delete(PLAN)
            return 0
    return plan.seq


def forget(backend: Backend) -> None:
    """A publisher starting afresh: the plan's position means nothing to its journal."""
    backend.delete(PLAN)
