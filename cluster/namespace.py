"""One daemon's replica of the cluster's namespace.

A namespace change made on this node (a FUSE request) is appended to the
shared log (`cluster.log`) and takes effect here only when this replica
applies it at its place in the log, exactly as on every other node: the
tree's own code decides it (the same checks, the same errors, the same
inode numbers), against the namespace as it is at that place. Changes made
on other nodes are applied as they arrive (`follow`), within milliseconds.

What stays local to each node: file contents, open handles, and the
kernel's references; only names, links, modes, owners, times and extended
attributes are shared.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import time
import uuid
from collections.abc import Callable
from typing import Any

import trio
from ckptfs.fs.tree import Handle, InodeTree

from .log import READ_BATCH, SharedLog

log = logging.getLogger(__name__)

FOLLOW_BLOCK_S = 1.0
# The tree's methods a log entry may name: every change of names, links and attributes.
CHANGES = frozenset({"mknod", "mkdir", "symlink", "link", "unlink", "rmdir", "rename", "setattr", "setxattr", "removexattr"})


class SharedNamespace:
    def __init__(self, tree: InodeTree, log_: SharedLog, node: str) -> None:
        self.tree = tree
        self.log = log_
        self.node = node  # for humans: which node made a change
        self.me = uuid.uuid4().hex  # this daemon, as the author of its entries
        self.position = 0  # the last log position applied to the tree
        self._outcomes: dict[int, Any] = {}  # position of an entry of ours -> what applying it gave
        self._appending = trio.Lock()  # this node's own appends, one at a time: they would only race each other
        self.applied = trio.Event()  # set (and replaced) whenever entries are applied

    # -- changes made here -------------------------------------------------------
    async def change(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """Make a namespace change through the log: what the tree's method
        returns once this replica applied it, or the OSError it raised (on
        every replica alike)."""
        if op not in CHANGES:
            raise ValueError(f"not a shared namespace change: {op}")
        if kwargs.get("size") is not None:
            raise ValueError("a size change is a change of the file's bytes: made where they are, shared when sealed")
        raw = _encode(self.me, self.node, op, args, kwargs)
        async with self._appending:
            while True:
                after = self.position
                pos = await trio.to_thread.run_sync(self.log.append, after, raw)
                if pos is not None:
                    break
                await self.catch_up()  # another node appended first: apply that, then try again after it
            while self.position < pos:
                await self.catch_up()
        outcome = self._outcomes.pop(pos)
        if isinstance(outcome, OSError):
            raise outcome
        return outcome

    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int,
                     keeps_setid: Callable[[], bool]) -> Handle:
        """open(O_CREAT): the name is made through the log unless it exists
        here already; opening is local."""
        try:
            inode = self.tree.lookup(parent, name)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
            inode = None
        if inode is None:
            try:
                inode = await self.change("mknod", parent, name, stat.S_IFREG | (mode & 0o7777), uid, gid)
            except OSError as exc:  # another node made it first
                if exc.errno != errno.EEXIST or flags & os.O_EXCL:
                    raise
                inode = self.tree.lookup(parent, name)
        elif flags & os.O_EXCL:
            raise OSError(errno.EEXIST, os.strerror(errno.EEXIST))
        if inode.is_dir:
            raise OSError(errno.EISDIR, os.strerror(errno.EISDIR))
        return self.tree.open(inode.ino, flags, keeps_setid)

    # -- changes made anywhere ---------------------------------------------------
    async def catch_up(self) -> int:
        """Apply every entry the log has after this replica's position; how many."""
        n = 0
        while True:
            got = await trio.to_thread.run_sync(self.log.read, self.position)
            n += self._apply_all(got)
            if len(got) < READ_BATCH:
                return n

    async def follow(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Apply other nodes' changes as they arrive, for as long as the daemon runs."""
        await self.catch_up()
        task_status.started()
        while True:
            got = await trio.to_thread.run_sync(self.log.wait, self.position, FOLLOW_BLOCK_S, abandon_on_cancel=True)
            self._apply_all(got)

    def _apply_all(self, entries: list[tuple[int, bytes]]) -> int:
        n = 0
        for pos, raw in entries:
            if pos <= self.position:  # applied already, by another task reading the same entries
                continue
            if pos != self.position + 1:
                raise RuntimeError(f"the cluster log skips from {self.position} to {pos}")
            self._apply(pos, raw)
            n += 1
        if n:
            self.applied.set()
            self.applied = trio.Event()
        return n

    def _apply(self, pos: int, raw: bytes) -> None:
        author, node, when, op, args, kwargs = _decode(raw)
        tree = self.tree
        tree.clock = lambda: when
        try:
            outcome: Any = getattr(tree, op)(*args, **kwargs) if op in CHANGES else OSError(errno.EINVAL, f"unknown change {op}")
        except OSError as exc:
            outcome = exc
        except Exception as exc:  # a bug: every replica meets it alike, so the namespaces still agree
            log.exception("applying change %d (%s by %s) failed", pos, op, node)
            outcome = OSError(errno.EIO, f"{op}: {exc}")
        finally:
            tree.clock = time.time_ns
        self.position = pos
        if author == self.me:
            self._outcomes[pos] = outcome


def _encode(author: str, node: str, op: str, args: tuple, kwargs: dict) -> bytes:
    return json.dumps({"by": author, "node": node, "t": time.time_ns(), "op": op,
                       "a": [_to_json(a) for a in args], "k": {k: _to_json(v) for k, v in kwargs.items()}}).encode()


def _decode(raw: bytes) -> tuple[str, str, int, str, list, dict]:
    e = json.loads(raw)
    return e["by"], e["node"], e["t"], e["op"], [_of_json(a) for a in e["a"]], {k: _of_json(v) for k, v in e["k"].items()}


def _to_json(v: Any) -> Any:
    # Names are bytes, any bytes but "/" and NUL: kept exactly (surrogate escapes survive JSON)
    return {"b": os.fsdecode(v)} if isinstance(v, bytes) else v


def _of_json(v: Any) -> Any:
    return os.fsencode(v["b"]) if isinstance(v, dict) else v

