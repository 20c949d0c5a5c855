"""A daemon as one node of a cluster: joins it, keeps its replica of the
namespace and its heartbeat, and ties its write-back engine to the others.

    join (before the mount)    Redis reached, the cluster's store checked;
                               the first node publishes and starts afresh,
                               the others wait until it has restored the store
                               and load the namespace's snapshot, if any
    start (in the daemon)      the publishing node restores the store and puts
                               the result in the log; every node replays the
                               log (after the snapshot), then follows it,
                               places its seals, beats; the publishing node
                               takes snapshots and trims the log (`snapshot`)
    take over                  the publishing node is gone: one of the others
                               takes its key and publishes from where it stopped
"""

from __future__ import annotations

import logging
import socket
import stat
import time

import redis
import trio
from ckptfs.fs.tree import InodeTree
from ckptfs.writeback.engine import Engine
from ckptfs.writeback.following import Following
from ckptfs.writeback.journal import FileGen

from . import snapshot
from .events import Events, until_redis_answers
from .log import ClusterError, SharedLog, Where
from .members import BEAT_S, GONE_AFTER_S, Membership, dead_here
from .namespace import REDIS_PATIENCE_S, SharedNamespace

log = logging.getLogger(__name__)


class ClusterNode:
    def __init__(self, where: Where, store_url: str, tree: InodeTree, engine: Engine, node: str | None = None,
                 patience_s: float = REDIS_PATIENCE_S, snapshot_every: int = snapshot.EVERY) -> None:
        self.name = node or socket.gethostname()
        self.shared = SharedLog(where)
        self.shared.open(store_url)  # ClusterError: unreachable, refused, another store
        self.namespace = SharedNamespace(tree, self.shared, self.name, engine, patience_s)
        self.members = Membership(self.shared, self.namespace.me, self.name)
        self.engine = engine
        self.events: Events | None = None
        self.leader_gone = False
        self.unreachable = False
        self.beating_since = 0.0  # trio time of the first heartbeat after Redis last failed to answer
        self.taking_over = False
        self._nursery: trio.Nursery | None = None
        self._names: dict[str, str] = {}  # node id -> its name, as heartbeats said (a node that left has none)
        self.snapshot_every = snapshot_every  # log entries between snapshots (this node publishes)
        self.snapshot_at = 0  # the log position of the last snapshot this node took or loaded

    @property
    def publishes(self) -> bool:
        return self.members.publishes

    def join(self) -> None:
        """Join the cluster (a blocking call, before the mount serves)."""
        try:
            publishes = self.members.join()
            sealed = None
            if not publishes:
                leader = self.members.wait_ready()
                log.info("joined the cluster as node %s; node %s publishes for it", self.name,
                         self.members.members().get(leader, {}).get("node", leader[:8]))
                sealed = self.namespace.load_snapshot()
                self.snapshot_at = self.namespace.position
            else:
                leader = self.namespace.me
                log.info("started the cluster as node %s: this node publishes for it", self.name)
            self.events = Events(self.shared, self.engine, self.namespace.me, publishes, leader)
            self.engine.cluster(self.events, self.engine.publisher if publishes else Following(self.engine, self.engine.publisher.markers))
            self.events.start()  # after the snapshot: what the publishing node says is held is as recent as it
        except redis.RedisError as exc:
            raise ClusterError(f"cannot join the cluster: {exc}") from None
        if sealed is not None:
            self.engine.adopt(sealed, self.namespace.position)

    async def start(self, nursery: trio.Nursery) -> int:
        """Show the namespace (the publishing node restores it from the store
        first) and run the node's tasks; how many files the store held."""
        assert self.events is not None
        self._nursery = nursery
        nursery.start_soon(self._beat)  # first: restoring a large store must not look like a dead node
        n = 0
        if self.publishes:
            restoring = _Noted(self.namespace.tree)
            n = await self.engine.scan(restoring)
            await self.namespace.restored(restoring.entries)
            await trio.to_thread.run_sync(self.members.ready)
        await nursery.start(self.namespace.follow)
        await nursery.start(self.namespace.place_seals)
        await nursery.start(self.events.run)
        return n

    async def _beat(self) -> None:
        assert self.events is not None
        while True:
            await trio.sleep(BEAT_S)
            try:
                sent = time.monotonic()
                still = await trio.to_thread.run_sync(self.members.beat, self.namespace.position, bool(self.namespace.behind))
                leader = await trio.to_thread.run_sync(self.members.leader) if not (self.publishes and still) else self.namespace.me
                members = await trio.to_thread.run_sync(self.members.members)
                if self.publishes and not still:  # another node took the key: this node follows it
                    self._follow(leader, await trio.to_thread.run_sync(self.events.leader_progress), members)
            except redis.RedisError as exc:
                if not self.unreachable:  # once per outage
                    log.warning("cannot reach the cluster's Redis for this node's heartbeat: %s", exc)
                    self.unreachable = True
                continue
            if self.unreachable or not self.beating_since:
                self.beating_since = trio.current_time()
            self.unreachable = False
            # Others' heartbeats are judged only once this node's own have run
            # a while: after Redis was away, every node's looks old at first.
            trusted = trio.current_time() - self.beating_since >= GONE_AFTER_S
            self._find_gone(members, trusted)
            if self.publishes:
                self.events.renew(sent)
                await self._snapshot()
            self._watch_leader(leader, members, trusted)

    async def _snapshot(self) -> None:
        """Take a snapshot of the namespace every `snapshot_every` log
        entries, when every entry up to this replica's position has had its
        turn at the store (this node publishes), and trim the log to it."""
        assert self.events is not None
        position = self.namespace.position
        if position - self.snapshot_at < self.snapshot_every or self.engine.queue or self.engine.publisher.deferred or self.taking_over:
            return
        position, state = await self.namespace.take_snapshot()
        blob = await trio.to_thread.run_sync(snapshot.encode, position, state)
        self.events.save_snapshot(position, blob, snapshot.TRIM_GRACE_S)
        self.snapshot_at = position
        log.info("took a snapshot of the cluster's namespace at log position %d (%d inodes, %d bytes)", position,
                 len(state["inodes"]), len(blob))

    def _follow(self, leader: str | None, position: int, members: dict[str, dict]) -> None:
        """This node published for the cluster and another node took over
        (this one was frozen or cut off from Redis longer than its lease:
        it changed the store no more since). It follows that node now."""
        assert self.events is not None
        self.members.publishes = False
        self.events.follow(leader or "", position)
        log.error("node %s took over publishing for the cluster while this node was frozen or cut off from Redis: this node "
                  "follows it now; the files this node held then are reported lost", members.get(leader or "", {}).get("node", "?"))

    def _watch_leader(self, leader: str | None, members: dict[str, dict], trusted: bool) -> None:
        """Another node's turn to publish: a node that took over is followed;
        a publishing node that is gone is replaced (`_take_over`)."""
        assert self.events is not None
        if self.publishes or self.taking_over:
            return
        self._names.update((m, info["node"]) for m, info in members.items())
        if leader is not None and leader != self.events.leader:
            self.events.leader = leader
            self._leader_back()
            log.info("node %s now publishes for the cluster", self._name(leader))
            return
        old = members.get(self.events.leader)
        dead = old is not None and dead_here(old)
        if leader is not None and not dead:
            if self.leader_gone:  # its key lapsed while Redis was away, and it took it up again
                self._leader_back()
                log.info("the cluster's publishing node is back: publishing goes on")
            return
        name = self._name(self.events.leader)
        if old is None:  # it left the cluster (unmounted)
            why = f"the cluster's publishing node {name} left the cluster"
        elif dead or (trusted and old["age"] >= GONE_AFTER_S):
            why = f"the cluster's publishing node {name} is gone"
        else:
            why = ""
        if not self.leader_gone:
            self.leader_gone = True
            self.engine.stalled = why or f"the cluster's publishing node ({name}) is not keeping its key: a node takes over once it is gone"
            log.log(logging.INFO if old is None else logging.WARNING, "%s", self.engine.stalled)
        if why:
            self.taking_over = True
            assert self._nursery is not None
            self._nursery.start_soon(self._take_over, why, logging.INFO if old is None else logging.WARNING)

    def _name(self, node: str) -> str:
        return self._names.get(node, node[:8])

    def _leader_back(self) -> None:
        self.leader_gone = False
        self.engine.stalled = ""
        self.engine.notify()

    async def _take_over(self, why: str, level: int) -> None:
        """Publish for the cluster in place of the node that did (gone)."""
        assert self.events is not None
        try:
            sent = time.monotonic()
            won = await trio.to_thread.run_sync(self.members.take_over, self.events.leader)
        except redis.RedisError as exc:
            log.warning("cannot take over publishing for the cluster yet: %s", exc)
            won = False
        if not won:  # another node did (the next heartbeat follows it), or Redis did not answer
            self.taking_over = False
            return
        log.log(level, "%s: this node takes over publishing", why)
        await until_redis_answers(self.namespace.catch_up)  # the whole log applied: the journal this node takes over
        await self.events.take_over(sent)
        await until_redis_answers(trio.to_thread.run_sync, self.members.ready)
        self.events.leader, self.taking_over = self.namespace.me, False
        self._leader_back()
        log.info("this node now publishes for the cluster")

    def _find_gone(self, members: dict[str, dict], trusted: bool) -> None:
        """Nodes holding unstaged generations that stopped beating: what
        they held is lost (reported on every node, never waited for in
        silence). `trusted`: heartbeat ages mean something (else only a
        daemon gone from this host counts)."""
        for owner in list(self.engine.gone):  # beating again: it was frozen or cut off, not dead
            info = members.get(owner)
            if trusted and info is not None and info["age"] < GONE_AFTER_S and not dead_here(info):
                self.engine.back(owner, info["node"])
        owners = {g.owner for g in self.engine.pending.values() if g.owner is not None and g.owner not in self.engine.gone}
        for owner in owners:
            info = members.get(owner)
            if info is not None and not dead_here(info) and (info["age"] < GONE_AFTER_S or not trusted):
                continue
            name = info["node"] if info is not None else owner[:8]
            why = f"node {name} is gone (no heartbeat for {GONE_AFTER_S:.0f}s)" if info is not None else f"node {name} left the cluster"
            if info is not None and dead_here(info):
                why = f"node {name} died (its daemon, pid {info['pid']} on this host, is gone)"
            self.engine.lost(owner, why)

    async def status(self) -> dict:
        """The cluster as this node sees it: every node (a heartbeat, or
        generations in the journal) with what it has not published yet and
        what was lost with it; which node publishes; the log position."""
        members = await trio.to_thread.run_sync(self.members.members)
        leader = await trio.to_thread.run_sync(self.members.leader)
        kept = await trio.to_thread.run_sync(self.shared.snapshot_position)
        per: dict[str, dict] = {}
        for op in self.engine.unpublished():
            if isinstance(op, FileGen):
                c = per.setdefault(op.owner or self.namespace.me, {"unpublished_files": 0, "unpublished_bytes": 0, "lost_files": 0})
                if op.lost:
                    c["lost_files"] += 1
                else:
                    c["unpublished_files"] += 1
                    c["unpublished_bytes"] += op.size
        nodes = []
        for me in sorted(set(members) | set(per)):
            info = members.get(me, {})
            nodes.append({"node": info.get("node", "?"), "id": me, "host": info.get("host", ""), "pid": info.get("pid"),
                          "heartbeat_age_s": info.get("age"), "publishes": me == leader, "this": me == self.namespace.me,
                          "gone": me in self.engine.gone or me not in members,
                          **per.get(me, {"unpublished_files": 0, "unpublished_bytes": 0, "lost_files": 0})})
        return {"nodes": nodes, "log_position": self.namespace.position, "snapshot_position": kept,
                "publishing_node_gone": leader is None, "behind": self.namespace.behind}

    async def settle(self, deadline: float) -> None:
        """At unmount, before the drain, until `deadline` (trio's clock):
        this node's seals placed and the log applied up to its end
        (`SharedNamespace.settle`). While Redis does not answer this waits,
        as the drain waits for the store (not when this node can apply the
        log no more: `behind`); what is then left unplaced is reported
        (`unplaced`), and what other nodes sealed meanwhile is left to the
        node publishing next."""
        error: Exception | str = "no answer"
        with trio.move_on_at(deadline):
            while not self.namespace.behind:
                try:
                    await self.namespace.settle()
                    return
                except (OSError, redis.RedisError) as exc:
                    error = exc
                    await trio.sleep(1.0)
        log.warning("cannot use the cluster's log at unmount (%s): what other nodes sealed since position %d is left to "
                    "the node publishing next", self.namespace.behind or error, self.namespace.position)

    def unplaced(self) -> list[str]:
        """The files this node sealed whose seals never got their places in
        the log (Redis did not answer until the unmount's deadline): never
        published, as the exit report lists them."""
        tree = self.namespace.tree
        return [f"{next(iter(tree.paths_of(ino)), f'inode {ino}')} ({size} bytes, generation {generation}, sealed, but the "
                "cluster's Redis never gave it a place in the log)" for ino, generation, size in self.namespace.unplaced()]

    def leave(self) -> None:
        try:
            self.members.leave()
        except redis.RedisError as exc:
            log.warning("cannot leave the cluster cleanly (%s): its heartbeat lapses instead", exc)
        self.shared.close()


class _Noted:
    """The tree, as a restart restores into it, noting every entry restored
    (`SharedNamespace.restored` hands them to the other nodes)."""

    def __init__(self, tree: InodeTree) -> None:
        self.tree = tree
        self.entries: list[list] = []  # [path, mode, size, mtime_ns, target, uid, gid]

    def restore(self, path, mode, size=0, mtime_ns=None, target="", uid=None, gid=None):
        self.entries.append([path, mode, size, mtime_ns, target, uid, gid])
        return self.tree.restore(path, mode, size, mtime_ns, target, uid, gid)

    def restore_files(self, parent, files):
        for name, mode, size, mtime_ns, uid, gid in files:
            self.entries.append([f"{parent}/{name}" if parent else name, stat.S_IFREG | mode, size, mtime_ns, "", uid, gid])
        return self.tree.restore_files(parent, files)

    def inode_at(self, path):
        return self.tree.inode_at(path)
