"""Who is in a cluster, and which node publishes for it.

Each daemon keeps a heartbeat in Redis while it runs. The first daemon to
join a cluster that has no daemon running becomes its publishing node: it
starts the cluster afresh (an empty log: the namespace is what the store
holds, restored from it as a single-node mount would, since data that lived
only in RAM did not outlive the daemons that held it), and its `Publisher`
applies the cluster's journal to the store. The other daemons wait until it
has restored the store (`ready`), then replay the log.

The publishing node holds a key in Redis that lapses unless its heartbeat
keeps it (`LEADER_TTL_S`), and changes the store only within a shorter lease
(`LEASE_S`) from its last kept heartbeat. When it is gone (its key lapsed,
or its daemon is gone from this host), another node takes the key
(`take_over`) and publishes from where it stopped.
"""

from __future__ import annotations

import json
import os
import socket
import time

from .log import ClusterError, SharedLog

BEAT_S = 1.0
LEADER_TTL_S = 10.0  # a publishing node silent this long is gone
LEASE_S = 0.7 * LEADER_TTL_S  # it stops changing the store this long after its last kept heartbeat
GONE_AFTER_S = 5.0  # any other node silent this long is gone
LEAVE_TIMEOUT_S = 1.0  # leaving at exit waits no longer for Redis: a node that does not leave lapses all the same
READY_TIMEOUT_S = 120.0

# KEYS: leader, head, log, ready, events, members, progress, held, snapshot.
# ARGV: me, ttl ms. 1 if this daemon now publishes (the cluster was started
# afresh), else 0.
_JOIN = """
if redis.call('GET', KEYS[1]) then return 0 end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: leader. ARGV: me, ttl ms. 1 if still the publishing node: its key
# kept, or taken again after it lapsed while no other node took it (Redis
# paused or unreachable longer than the ttl).
_KEEP = """
local leader = redis.call('GET', KEYS[1])
if leader == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]); return 1 end
if not leader then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]); return 1 end
return 0
"""

# KEYS: leader, ready. ARGV: the publishing node that is gone, me, ttl ms.
# 1 if this daemon now publishes (it restores its replica of the store, then sets `ready`).
_TAKE = """
local leader = redis.call('GET', KEYS[1])
if leader and leader ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('DEL', KEYS[2])
return 1
"""

# KEYS: leader, ready. ARGV: me.
_LEAVE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1], KEYS[2]) end
return 1
"""


def dead_here(info: dict) -> bool:
    """A member on this host whose daemon process is gone."""
    if info.get("host") != socket.gethostname():
        return False
    try:
        os.kill(info["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _now(r) -> float:
    """Redis's clock: heartbeats of nodes on different hosts are compared on one clock."""
    sec, usec = r.time()
    return sec + usec / 1e6


class Membership:
    def __init__(self, shared: SharedLog, me: str, node: str) -> None:
        self.shared = shared
        self.me = me
        self.node = node
        p = shared.prefix
        self.leader_key, self.ready_key, self.members_key = p + "leader", p + "ready", p + "members"
        r = shared.redis
        self._join = r.register_script(_JOIN)
        self._keep = r.register_script(_KEEP)
        self._take = r.register_script(_TAKE)
        self._leave = r.register_script(_LEAVE)
        self.publishes = False

    def join(self) -> bool:
        """Join; True if this daemon publishes for the cluster (and starts it
        afresh). ClusterError if the publishing node is gone while other
        nodes still run: starting afresh would pull their namespace from under them."""
        s = self.shared
        deadline = time.monotonic() + LEADER_TTL_S + 2 * GONE_AFTER_S
        while self.leader() is None:
            live = {i["node"] for m, i in self.members().items() if m != self.me and i["age"] < GONE_AFTER_S and not dead_here(i)}
            if not live:
                break
            if time.monotonic() > deadline:  # none of them took over publishing
                raise ClusterError(f"the cluster's publishing node is gone and none of the {len(live)} node(s) still running "
                                   f"({', '.join(sorted(live))}) took over: unmount every node of the cluster, then mount again")
            time.sleep(0.2)  # one of them is taking over
        self.publishes = bool(self._join(keys=[self.leader_key, s.head_key, s.log_key, self.ready_key, s.prefix + "events",
                                               self.members_key, s.prefix + "progress", s.prefix + "applied", s.prefix + "held",
                                               s.snapshot_key],
                                         args=[self.me, int(LEADER_TTL_S * 1000)]))
        self.beat()
        return self.publishes

    def ready(self) -> None:
        """The publishing node restored the store: the others may replay the log."""
        self.shared.redis.set(self.ready_key, self.me)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> str:
        """Until the publishing node has restored the store; its id."""
        r = self.shared.redis
        deadline = time.monotonic() + timeout_s
        asked = 0.0
        while True:
            leader, ready = r.get(self.leader_key), r.get(self.ready_key)
            if leader is not None and leader == ready:
                return leader.decode()
            if leader is not None and time.monotonic() - asked >= 1.0:
                # Redis lost its data (restarted without persistence, flushed):
                # the publishing node keeps its key, but the cluster's log is
                # gone and it will never be ready again.
                asked = time.monotonic()
                info = self.members().get(leader.decode(), {})
                if info.get("behind"):
                    raise ClusterError(f"the cluster's publishing node ({info.get('node', leader.decode()[:8])}) lost the cluster's "
                                       "log (Redis lost its data?): unmount every node of the cluster, then mount again")
            if time.monotonic() > deadline:
                raise ClusterError(f"the cluster's publishing node ({(leader or b'none').decode()}) did not finish "
                                   f"restoring the store within {timeout_s:.0f}s")
            time.sleep(0.05)

    def beat(self, position: int = 0, behind: bool = False) -> bool:
        """This daemon's heartbeat, with how far it applied the cluster's
        log (`position`: the log is not trimmed past it, unless `behind`:
        this node fell behind it for good); False if it was the publishing
        node and no longer is."""
        r = self.shared.redis
        r.hset(self.members_key, self.me, json.dumps({"node": self.node, "host": socket.gethostname(), "pid": os.getpid(),
                                                       "beat": _now(r), "publishes": self.publishes, "position": position,
                                                       "behind": behind}))
        if self.publishes:
            return bool(self._keep(keys=[self.leader_key], args=[self.me, int(LEADER_TTL_S * 1000)]))
        return True

    def take_over(self, gone: str) -> bool:
        """Become the publishing node in place of `gone`; False if another node did first."""
        won = bool(self._take(keys=[self.leader_key, self.ready_key], args=[gone, self.me, int(LEADER_TTL_S * 1000)]))
        self.publishes = self.publishes or won
        return won

    def leader(self) -> str | None:
        got = self.shared.redis.get(self.leader_key)
        return got.decode() if got is not None else None

    def members(self) -> dict[str, dict]:
        """Every daemon that has a heartbeat, with its details and `age` (s since its last beat)."""
        now = _now(self.shared.redis)
        out = {}
        for me, raw in self.shared.redis.hgetall(self.members_key).items():
            info = json.loads(raw)
            info["age"] = now - info["beat"]
            out[me.decode()] = info
        return out

    def leave(self) -> None:
        """Take this daemon's heartbeat out of the cluster, and the
        publishing node's key if it holds it, so that others need not wait
        for them to lapse. On a connection of its own that gives up after
        `LEAVE_TIMEOUT_S`: a daemon exiting while Redis stood still waited a
        whole Redis call (5 s) more for this, a second signal or not."""
        r = self.shared.brief(LEAVE_TIMEOUT_S)
        try:
            r.hdel(self.members_key, self.me)
            if self.publishes:
                self._leave(keys=[self.leader_key, self.ready_key], args=[self.me], client=r)
        finally:
            r.close()
