"""The cluster's log of namespace changes, kept in Redis.

Every daemon of a cluster holds a replica of one namespace (`fs.tree`), and
the namespace is the result of one ordered log of changes that all of them
apply in the same order. Redis keeps the log (a stream) and orders it: a
change is appended only if the appender has applied every change before it
(`append(after=...)`, one Lua script: atomic on the server), so each change
is decided against the namespace as it is at its place in the log, and every
replica that applies the log reaches the same namespace. A log position is
the change's sequence number in the cluster.

Keys, under one prefix per cluster: `head` (the last position), `log` (the
stream; entry ids are `<position>-1`), `store` (the store URL the cluster
was created for: one cluster, one store), `snapshot` (the namespace at one
position, `cluster.snapshot`: the log before it is trimmed away).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import redis

PREFIX = "ckptfs:"
CALL_TIMEOUT_S = 5.0  # one Redis call; a blocking read waits longer than its block
READ_BATCH = 1000
PASSWORD_ENV = "CKPTFS_REDIS_PASSWORD"

# KEYS: head, log. ARGV: the position the appender has applied, the entry.
# Returns the entry's position, -1 if someone appended after `after`, or -2
# if the log ends before `after` (Redis lost it).
_APPEND = """
local head = tonumber(redis.call('GET', KEYS[1]) or '0')
if head < tonumber(ARGV[1]) then return -2 end
if head ~= tonumber(ARGV[1]) then return -1 end
head = head + 1
redis.call('SET', KEYS[1], head)
redis.call('XADD', KEYS[2], head .. '-1', 'e', ARGV[2])
return head
"""

# KEYS: store. ARGV: the store URL. Returns the URL the cluster was made for.
_CLAIM_STORE = """
local there = redis.call('GET', KEYS[1])
if not there then redis.call('SET', KEYS[1], ARGV[1]); return ARGV[1] end
return there
"""


# KEYS: snapshot, log, members. ARGV: its position, the snapshot, the
# seconds after which a silent member no longer counts. Saves the snapshot
# unless one as recent is there, and trims the log to the entries after
# it that a member beating still needs (its heartbeat says how far it
# applied the log; one joining says 0 until it has loaded the snapshot; one
# that fell behind the log for good says so, and needs none of it).
# Returns the first position kept, or 0 if not saved.
_SAVE_SNAPSHOT = """
local position = tonumber(ARGV[1])
if position <= tonumber(redis.call('HGET', KEYS[1], 'position') or '-1') then return 0 end
redis.call('HSET', KEYS[1], 'position', ARGV[1], 'blob', ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local keep = position
local members = redis.call('HGETALL', KEYS[3])
for i = 2, #members, 2 do
  local m = cjson.decode(members[i])
  if now - m['beat'] < tonumber(ARGV[3]) and not m['behind'] then keep = math.min(keep, tonumber(m['position'] or 0)) end
end
redis.call('XTRIM', KEYS[2], 'MINID', string.format('%d-0', keep + 1))
return keep + 1
"""


class ClusterError(RuntimeError):
    """Redis cannot be used as this cluster's metadata engine; the message says why, in one line."""


class LogLost(RuntimeError):
    """The log in Redis ends before what this node has applied: Redis lost
    it (restarted without persistence, flushed, or evicting keys)."""

    def __init__(self, head: int, applied: int) -> None:
        super().__init__(f"the cluster's log in Redis ends at {head}, before the {applied} changes this node applied: Redis lost it "
                         "(restarted without persistence, flushed, or evicting keys under maxmemory)")


@dataclass(frozen=True)
class Where:
    """How to reach a cluster's Redis: a `redis://` or `rediss://` (TLS) URL,
    and its password from the environment or a file, never the command line."""

    url: str
    password_file: str | None = None

    def password(self) -> str | None:
        if self.password_file:
            try:
                return Path(self.password_file).read_text().strip() or None
            except OSError as exc:
                raise ClusterError(f"cannot read the Redis password file {self.password_file}: {exc.strerror or exc}") from None
        return os.environ.get(PASSWORD_ENV) or None


def _client(where: Where, timeout_s: float, connect_s: float = CALL_TIMEOUT_S) -> redis.Redis:
    if not where.url.startswith(("redis://", "rediss://", "unix://")):
        raise ClusterError(f"not a Redis URL: {where.url!r} (expected redis://HOST:PORT/DB or rediss://... for TLS)")
    kwargs: dict = {"socket_timeout": timeout_s, "socket_connect_timeout": connect_s}
    password = where.password()
    if password is not None:
        kwargs["password"] = password
    try:
        return redis.Redis.from_url(where.url, **kwargs)
    except ValueError as exc:
        raise ClusterError(f"bad Redis URL {where.url!r}: {exc}") from None


def _describe(where: Where) -> str:
    """The URL without a password in it."""
    scheme, sep, rest = where.url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else where.url


class SharedLog:
    def __init__(self, where: Where, prefix: str = PREFIX) -> None:
        self.where = where
        self.prefix = prefix
        self.head_key, self.log_key, self.store_key = prefix + "head", prefix + "log", prefix + "store"
        self.snapshot_key = prefix + "snapshot"
        self._r = _client(where, CALL_TIMEOUT_S)
        self._append = self._r.register_script(_APPEND)
        self._claim_store = self._r.register_script(_CLAIM_STORE)
        self._save_snapshot = self._r.register_script(_SAVE_SNAPSHOT)
        self._waiter: redis.Redis | None = None  # its own connection: a blocking read holds it

    def open(self, store_url: str) -> None:
        """Reach Redis and join the cluster of `store_url`: ClusterError if
        Redis cannot be reached or its cluster has another store."""
        try:
            self._r.ping()
            there = self._claim_store(keys=[self.store_key], args=[store_url])
        except (redis.AuthenticationError, redis.ResponseError) as exc:
            if isinstance(exc, redis.AuthenticationError) or "NOAUTH" in str(exc):
                if self.where.password() is None:
                    raise ClusterError(f"Redis at {_describe(self.where)} needs a password (set {PASSWORD_ENV} or a password file)") from None
                raise ClusterError(f"Redis at {_describe(self.where)} refused the password") from None
            raise ClusterError(f"Redis at {_describe(self.where)} refused: {exc}") from None
        except redis.RedisError as exc:
            raise ClusterError(f"cannot reach Redis at {_describe(self.where)}: {exc}") from None
        if there.decode() != store_url:
            raise ClusterError(f"the cluster at {_describe(self.where)} keeps the namespace of store {there.decode()}, not {store_url}")

    def append(self, after: int, entry: bytes) -> int | None:
        """Append `entry` if the log ends at `after`; its position, or None if
        it ends later. LogLost if it ends before."""
        got = int(self._append(keys=[self.head_key, self.log_key], args=[after, entry]))
        if got == -2:
            raise LogLost(self.head(), after)
        return None if got < 0 else got

    def check(self, applied: int) -> None:
        """LogLost if the log ends before `applied` (no entry will ever come
        after it: a node waiting for one must hear why)."""
        head = self.head()
        if head < applied:
            raise LogLost(head, applied)

    def read(self, after: int) -> list[tuple[int, bytes]]:
        """Entries after position `after`, in order (at most READ_BATCH)."""
        return _entries(self._r.xrange(self.log_key, min=f"({after}-1", count=READ_BATCH))

    def wait(self, after: int, block_s: float) -> list[tuple[int, bytes]]:
        """Entries after `after`, waiting up to `block_s` for the first."""
        if self._waiter is None:
            self._waiter = _client(self.where, block_s + CALL_TIMEOUT_S)
        got = self._waiter.xread({self.log_key: f"{after}-1"}, count=READ_BATCH, block=max(1, int(block_s * 1000)))
        return _entries(got[0][1]) if got else []

    def snapshot(self) -> tuple[int, bytes] | None:
        """The newest snapshot of the namespace: its position and its bytes."""
        position, blob = self._r.hmget(self.snapshot_key, ["position", "blob"])
        return None if position is None or blob is None else (int(position), blob)

    def snapshot_position(self) -> int:
        """The log position of the newest snapshot (0: none yet)."""
        return int(self._r.hget(self.snapshot_key, "position") or 0)

    def save_snapshot(self, pipe: redis.client.Pipeline, position: int, blob: bytes, grace_s: float) -> None:
        """In `pipe`: keep `blob` as the snapshot at `position` (unless one
        as recent is kept), and trim the log before it, keeping what the
        members that beat within `grace_s` have not applied yet."""
        self._save_snapshot(keys=[self.snapshot_key, self.log_key, self.prefix + "members"], args=[position, blob, grace_s],
                            client=pipe)

    @property
    def redis(self) -> redis.Redis:
        return self._r

    def waiter(self, block_s: float) -> redis.Redis:
        """A connection of its own for blocking reads of up to `block_s`."""
        return _client(self.where, block_s + CALL_TIMEOUT_S)

    def brief(self, timeout_s: float) -> redis.Redis:
        """A connection of its own that waits at most `timeout_s` to connect
        and for each call: for a call worth only a short wait."""
        return _client(self.where, timeout_s, timeout_s)

    def head(self) -> int:
        return int(self._r.get(self.head_key) or 0)

    def close(self) -> None:
        for client in (self._r, self._waiter):
            if client is not None:
                client.close()


def _entries(rows) -> list[tuple[int, bytes]]:
    return [(int(eid.split(b"-")[0]), fields[b"e"]) for eid, fields in rows]
