"""One daemon's replica of the cluster's namespace.

A namespace change made on this node (a FUSE request) is appended to the
shared log (`cluster.log`) and takes effect here only when this replica
applies it at its place in the log, exactly as on every other node: the
tree's own code decides it (the same checks, the same errors, the same
inode numbers), against the namespace as it is at that place. Changes made
on other nodes are applied as they arrive (`follow`), within milliseconds.

Seals go through the log too: a file sealed here gets its place in the log
(`sealed` entries, appended in the order the files were sealed), and every
node's write-back engine learns of it there. So every engine sees every seal
and namespace change of the whole cluster in one order, the log's: C3 across
nodes is the engine's own ordering, applied to that one sequence. On the
node that sealed it the generation's bytes are in RAM; elsewhere the file
shows its new size and loads from the store once published.

This replica is the tree's `Journal`: what the tree reports while applying
an entry goes on to the engine; a seal the tree reports outside of that (a
local close) waits for its place in the log first.

What stays local to each node: file contents, open handles, and the
kernel's references; names, links, modes, owners, times, extended
attributes and seals are shared.
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import stat
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import redis
import trio
from ckptfs.fs.tree import Handle, InodeTree, Journal

from . import snapshot
from .log import READ_BATCH, LogLost, SharedLog

log = logging.getLogger(__name__)

FOLLOW_BLOCK_S = 1.0
REDIS_PATIENCE_S = 10.0  # a namespace change or a close waits this long for an unreachable Redis, then fails with EIO (--cluster-patience)
APPEND_RETRY_S = 0.2
SNAPSHOT_SLICE = 5000  # inodes a snapshot takes between two turns of the event loop
SNAPSHOT_PAUSE_S = 0.0  # and the pause it makes there
# The tree's methods a log entry may name: every change of names, links and attributes.
CHANGES = frozenset({"mknod", "mkdir", "symlink", "link", "unlink", "rmdir", "rename", "setattr", "setxattr", "removexattr"})


class ClusterJournal(Journal, Protocol):
    """The write-back engine as a cluster node sees it (writeback.engine.Engine)."""

    def place(self, position: int) -> None: ...  # what follows comes from this log position
    def sealed_elsewhere(self, ino: int, generation: int, size: int, owner: str) -> None: ...


class SharedNamespace:
    def __init__(self, tree: InodeTree, log_: SharedLog, node: str, engine: ClusterJournal | None = None,
                 patience_s: float = REDIS_PATIENCE_S) -> None:
        self.tree = tree
        self.log = log_
        self.node = node  # for humans: which node made a change
        self.me = uuid.uuid4().hex  # this daemon, as the author of its entries
        self.engine = engine
        self.patience_s = patience_s  # how long a change or a close waits for a Redis that does not answer, then EIO
        self.position = 0  # the last log position applied to the tree
        self._count = 0  # entries of ours made so far: each is numbered
        self._outcomes: dict[int, Any] = {}  # number of an entry of ours -> what applying it gave
        self._appending = trio.Lock()  # this node's own appends, one at a time: they would only race each other
        self.applied = trio.Event()  # set (and replaced) whenever entries are applied
        self._applying = False
        self._warned: set[str] = set()  # what an outage of Redis was logged as (once each, until it answers again)
        self._unplaced: dict[tuple[int, int], Any] = {}  # (ino, generation) sealed here -> its snapshot, until placed
        self._to_place: list[tuple[int, bytes]] = []  # entries for seals (and the attributes a write changed) made here
        self._placing = trio.Event()  # set when an entry is queued
        self._shrunk = trio.Event()  # set (and replaced) when one has its place
        self._sealed: snapshot.Sealed = {}  # what each file was last sealed as in the log (for snapshots)
        self.behind = ""  # why this replica can apply the log no more (it was trimmed past it), or ""
        self._snapshotting: trio.Event | None = None  # set when a snapshot being taken is done: applying the log waits
        self._following = trio.CancelScope()  # `follow`, until `stop_following`
        # Told of every entry another node made, once applied: (op, args), to
        # drop what the kernel caches of the names and files it changed.
        self.elsewhere: Callable[[str, list], None] | None = None
        tree.journal = self

    # -- changes made here -------------------------------------------------------
    async def change(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """Make a namespace change through the log: what the tree's method
        returns once this replica applied it, or the OSError it raised (on
        every replica alike)."""
        if op not in CHANGES:
            raise ValueError(f"not a shared namespace change: {op}")
        if kwargs.get("size") is not None:
            raise ValueError("a size change is a change of the file's bytes: made where they are, shared when sealed")
        outcome = await self._append(self._encode(op, args, kwargs))
        if isinstance(outcome, OSError):
            raise outcome
        return outcome

    async def _append(self, entry: tuple[int, bytes], patience_s: float | None = None) -> Any:
        """Append an entry after everything this replica has applied, and
        apply up to it; what applying it gave. Redis unreachable: tried
        again for `patience_s` (default: the namespace's), then
        OSError(EIO). An append is conditional on the log's end, so trying
        again never appends twice: an append whose answer was lost is found
        applied when catching up."""
        n, raw = entry
        if self.behind:
            raise OSError(errno.EIO, self.behind)
        patience_s = self.patience_s if patience_s is None else patience_s
        deadline = trio.current_time() + patience_s
        warned = False
        async with self._appending:
            while n not in self._outcomes:
                try:
                    appended = await trio.to_thread.run_sync(self.log.append, self.position, raw)
                    await self.catch_up()  # another node appended first (None): apply that, then try again after it
                    if self.behind:
                        raise OSError(errno.EIO, self.behind)
                    assert appended is None or n in self._outcomes
                except LogLost as exc:
                    self._lost(exc)
                    raise OSError(errno.EIO, self.behind) from None
                except redis.RedisError as exc:
                    if trio.current_time() > deadline:
                        raise OSError(errno.EIO, f"the cluster's Redis is unreachable: {exc}") from None
                    if not warned:
                        log.warning("cannot reach the cluster's Redis (%s): trying again for %.0fs", exc, patience_s)
                        warned = True
                    await trio.sleep(APPEND_RETRY_S)
        return self._outcomes.pop(n)

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

    async def placed(self) -> None:
        """Until every seal made here so far has its place in the log (and
        so, on every node, comes before whatever happens after this call).
        OSError(EIO) after the namespace's patience (Redis unreachable): the
        seals keep their bytes in RAM and get their places once it answers
        again."""
        with trio.move_on_after(self.patience_s):
            while self._to_place:
                await self._shrunk.wait()
            return
        raise OSError(errno.EIO, "the cluster's Redis is unreachable: the file is kept in RAM and published once it answers")

    def unplaced(self) -> list[tuple[int, int, int]]:
        """The seals made here that have no place in the log yet: (ino, generation, size) each."""
        return [(ino, generation, snapshot.size) for (ino, generation), snapshot in self._unplaced.items()]

    async def place_seals(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Give each seal made here its place in the log, in the order they were made."""
        task_status.started()
        while True:
            if not self._to_place:
                await self._placing.wait()
                self._placing = trio.Event()
                continue
            try:
                await self._append(self._to_place[0], patience_s=0)
            except Exception as exc:  # Redis unreachable: the seal waits (its bytes stay in RAM); tried again
                self._unreachable(f"cannot give a seal its place in the cluster log yet ({exc}): trying again")
                await trio.sleep(0.5)
                continue
            self._to_place.pop(0)
            self._shrunk.set()
            self._shrunk = trio.Event()

    def _unreachable(self, what: str) -> None:
        kind = what.split(" (", 1)[0]
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("%s", what)

    # -- the tree's journal --------------------------------------------------------
    def sealed(self, ino: int, generation: int, snapshot) -> None:
        if self._applying:  # cannot happen: no change in the log seals (sizes are not shared changes)
            raise RuntimeError("a seal while applying a log entry")
        self._unplaced[(ino, generation)] = snapshot
        inode = self.tree.inodes[ino]
        self._queue(self._encode("sealed", (ino, generation, snapshot.size, inode.mtime_ns), {}))

    def grew(self, ino: int, data) -> None:  # this node's bytes, staged by this node: not a shared change
        if self.engine is not None:
            self.engine.grew(ino, data)

    def freed(self, ino: int) -> None:  # this node's tree let go of it (its handles, its kernel's references): not a shared change
        if self.engine is not None:
            self.engine.freed(ino)

    def changed_attrs(self, ino: int) -> None:
        if self._applying:
            if self.engine is not None:
                self.engine.changed_attrs(ino)
            return
        # A write cleared set-ID bits here: shared like a chmod
        inode = self.tree.inodes.get(ino)
        if inode is not None:
            self._queue(self._encode("setattr", (ino,), {"mode": inode.mode}))

    def renamed(self, src: str, dst: str, ino: int, is_dir: bool, replaced: int | None = None) -> None:
        if (journal := self._forward()) is not None:
            journal.renamed(src, dst, ino, is_dir, replaced)

    def exchanged(self, a: str, b: str) -> None:
        if (journal := self._forward()) is not None:
            journal.exchanged(a, b)

    def linked(self, ino: int, path: str) -> None:
        if (journal := self._forward()) is not None:
            journal.linked(ino, path)

    def removed(self, path: str, ino: int, is_dir: bool) -> None:
        if (journal := self._forward()) is not None:
            journal.removed(path, ino, is_dir)

    def made_dir(self, path: str, ino: int) -> None:
        if (journal := self._forward()) is not None:
            journal.made_dir(path, ino)

    def made_symlink(self, path: str, ino: int, target: str) -> None:
        if (journal := self._forward()) is not None:
            journal.made_symlink(path, ino, target)

    def _forward(self) -> Journal | None:
        if not self._applying:
            raise RuntimeError("a namespace change made here without the cluster log")
        return self.engine

    def _queue(self, entry: tuple[int, bytes]) -> None:
        self._to_place.append(entry)
        self._placing.set()

    # -- restore: the first node of a cluster shows the store ------------------------
    async def restored(self, entries: list[tuple]) -> None:
        """This node restored `entries` (`InodeTree.restore` arguments) from
        the store into its tree, starting the cluster: every node restores them."""
        if entries:
            await self._append(self._encode("restore", (), {"entries": entries}))

    # -- changes made anywhere ---------------------------------------------------
    async def catch_up(self) -> int:
        """Apply every entry the log has after this replica's position; how many."""
        n = 0
        while True:
            got = await trio.to_thread.run_sync(self.log.read, self.position)
            await self._not_snapshotting()
            n += self._apply_all(got)
            if len(got) < READ_BATCH or self.behind:
                return n

    async def refresh(self) -> None:
        """Catch up if Redis answers; if not, what this replica knows stands
        (a lookup or an open goes on with it)."""
        try:
            await self.catch_up()
        except redis.RedisError as exc:
            self._unreachable(f"cannot reach the cluster's Redis ({exc}): answering from this node's view of the namespace")

    async def follow(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Apply other nodes' changes as they arrive, until the daemon
        has drained at its unmount (`stop_following`)."""
        with self._following:
            await self.catch_up()
            task_status.started()
            await self._follow()

    async def settle(self) -> int:
        """At unmount, before the drain: every seal made here placed in the
        log (files still open at the unmount were sealed just now: their
        generations join the journal only once placed), then the log applied
        up to its end, whatever the follower has heard of it yet. Every file
        any node sealed before the unmount is then in this node's queue: the
        publishing node publishes it in its drain. How many entries it
        applied. OSError (EIO) or RedisError while Redis does not answer."""
        await self.placed()
        return await self.catch_up()

    def stop_following(self) -> None:
        """At unmount, after the drain: apply nothing more. The drain went
        on following the log (a seal it waits for may be superseded or
        deleted by a later entry); once it is over, what the publishing node
        would apply and publish next would race the manifest index it leaves
        (`Engine.leave_index`): the node taking over publishes it instead."""
        self._following.cancel()

    async def _follow(self) -> None:
        while True:
            if self.behind:  # nothing more to apply, ever: the daemon serves what it has until unmounted
                await trio.sleep(FOLLOW_BLOCK_S)
                continue
            try:
                got = await trio.to_thread.run_sync(self.log.wait, self.position, FOLLOW_BLOCK_S, abandon_on_cancel=True)
                if not got:  # quiet: is there a log to wait on still?
                    await trio.to_thread.run_sync(self.log.check, self.position)
            except LogLost as exc:
                self._lost(exc)
                continue
            except redis.RedisError as exc:
                self._unreachable(f"cannot read the cluster's log ({exc}): trying again")
                await trio.sleep(APPEND_RETRY_S * 5)
                continue
            if self._warned:
                log.info("the cluster's Redis answers again")
                self._warned.clear()
            await self._not_snapshotting()
            self._apply_all(got)

    def _lost(self, exc: LogLost) -> None:
        """Redis lost the log: this replica cannot be kept in step with any
        other any more. Namespace changes fail from now on (EIO); reads go
        on with what this node has."""
        if not self.behind:
            self.behind = (f"{exc}; this node's namespace can no longer be shared, so changes to it fail: "
                           "unmount every node of the cluster and mount again (keep Redis persistent: appendonly yes)")
            log.error("%s", self.behind)

    def _apply_all(self, entries: list[tuple[int, bytes]]) -> int:
        n = 0
        for pos, raw in entries:
            if pos <= self.position:  # applied already, by another task reading the same entries
                continue
            if pos != self.position + 1:  # trimmed: this node was away longer than the log is kept for it
                self.behind = (f"this node fell behind the cluster's log (it applied up to {self.position}, the log now "
                               f"starts at {pos}: it was frozen or cut off from Redis for over {snapshot.TRIM_GRACE_S:.0f}s); "
                               "unmount it and mount it again")
                log.error("%s", self.behind)
                break
            self._apply(pos, raw)
            n += 1
        if n:
            self.applied.set()
            self.applied = trio.Event()
        return n

    def _apply(self, pos: int, raw: bytes) -> None:
        author, number, node, when, op, args, kwargs = _decode(raw)
        tree = self.tree
        tree.clock = lambda: when
        self._applying = True
        if self.engine is not None:
            self.engine.place(pos)
        try:
            if op in CHANGES:
                outcome: Any = getattr(tree, op)(*args, **kwargs)
            elif op == "sealed":
                outcome = self._apply_seal(author, node, *args)
            elif op == "restore":
                outcome = None
                for entry in kwargs["entries"]:
                    inode = tree.restore(*entry) if author != self.me else None  # the first node restored them before it appended this
                    path, mode, size = entry[:3]
                    if stat.S_ISREG(mode) and (inode := inode or tree.inode_at(path)) is not None:
                        self._sealed[inode.ino] = (inode.generation, size, inode.mtime_ns)
            else:
                outcome = OSError(errno.EINVAL, f"unknown change {op}")
        except OSError as exc:
            outcome = exc
        except Exception as exc:  # a bug: every replica meets it alike, so the namespaces still agree
            log.exception("applying change %d (%s by %s) failed", pos, op, node)
            outcome = OSError(errno.EIO, f"{op}: {exc}")
        finally:
            tree.clock = time.time_ns
            self._applying = False
        self.position = pos
        if author == self.me:
            self._outcomes[number] = outcome
        elif self.elsewhere is not None:
            try:
                self.elsewhere(op, args)
            except Exception:
                log.exception("cannot drop what the kernel caches for change %d (%s)", pos, op)

    def _apply_seal(self, author: str, node: str, ino: int, generation: int, size: int, mtime_ns: int) -> None:
        tree = self.tree
        if tree.paths_of(ino):
            self._sealed[ino] = (generation, size, mtime_ns)
        if author == self.me:
            snapshot = self._unplaced.pop((ino, generation), None)
            if snapshot is None:
                return
            if not tree.paths_of(ino) or self.engine is None:  # deleted before its place: never published (C4)
                snapshot.release()
                return
            self.engine.sealed(ino, generation, snapshot)
            return
        keep = any(i == ino for i, _ in self._unplaced)  # sealed here since: that later seal wins
        if tree.sealed_elsewhere(ino, generation, size, mtime_ns, keep) is not None and tree.paths_of(ino) and self.engine is not None:
            self.engine.sealed_elsewhere(ino, generation, size, author)

    # -- snapshots (cluster.snapshot) -------------------------------------------------
    async def take_snapshot(self) -> tuple[int, dict]:
        """The namespace at this replica's position, and that position. It is
        taken a slice of inodes at a time: the log waits to be applied
        meanwhile (a namespace change waits), reads and writes go on."""
        done = self._snapshotting = trio.Event()
        try:
            position = self.position
            self._sealed = {ino: s for ino, s in self._sealed.items() if ino in self.tree.inodes}
            inodes = list(self.tree.inodes.values())
            rows: list[tuple] = []
            for i in range(0, len(inodes), SNAPSHOT_SLICE):
                rows += snapshot.rows(inodes[i : i + SNAPSHOT_SLICE], self._sealed)
                await trio.sleep(SNAPSHOT_PAUSE_S)
            return position, {"next_ino": self.tree.next_ino, "inodes": rows}
        finally:
            self._snapshotting = None
            done.set()

    async def _not_snapshotting(self) -> None:
        while self._snapshotting is not None:
            await self._snapshotting.wait()

    def load_snapshot(self) -> snapshot.Sealed | None:
        """A node joining a running cluster (before it serves): its replica
        becomes the newest snapshot's namespace, if there is one, and it
        replays only the log after it. The files sealed in it (a blocking call)."""
        got = self.log.snapshot()
        if got is None:
            return None
        collecting = gc.isenabled()
        gc.disable()  # a few objects per inode, kept as long as the mount: the cyclic collector would walk them again and again
        try:
            position, state = snapshot.decode(got[1])
            self._sealed = snapshot.load(self.tree, state)
        finally:
            if collecting:
                gc.enable()
        self.position = position
        log.info("loaded the cluster's namespace at log position %d: %d inodes", position, len(state["inodes"]))
        return self._sealed

    def _encode(self, op: str, args: tuple, kwargs: dict) -> tuple[int, bytes]:
        """A new entry of ours: its number and its bytes."""
        self._count += 1
        return self._count, json.dumps({"by": self.me, "n": self._count, "node": self.node, "t": time.time_ns(), "op": op,
                                        "a": [_to_json(a) for a in args], "k": {k: _to_json(v) for k, v in kwargs.items()}}).encode()


def _decode(raw: bytes) -> tuple[str, int, str, int, str, list, dict]:
    e = json.loads(raw)
    return (e["by"], e["n"], e["node"], e["t"], e["op"], [_of_json(a) for a in e["a"]],
            {k: _of_json(v) for k, v in e["k"].items()})


def _to_json(v: Any) -> Any:
    # Names are bytes, any bytes but "/" and NUL: kept exactly (surrogate escapes survive JSON)
    return {"b": os.fsdecode(v)} if isinstance(v, bytes) else v


def _of_json(v: Any) -> Any:
    return os.fsencode(v["b"]) if isinstance(v, dict) and set(v) == {"b"} else v
