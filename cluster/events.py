"""What the write-back engines of a cluster tell each other, through Redis.

One node's publisher applies the cluster's journal to the store (see
`writeback.following`); the others stage their own files and follow it:

- `staged`    a node staged a generation it holds: the publishing node shows it at its turn;
- `restage`   the publishing node found that staged data gone: its node stages it again;
- `published` the publishing node showed a generation at a path (its digest with it);
- `progress`  the publishing node applied every op of the journal up to a sequence number.

Events go through one Redis stream, each node reading all of it from the
moment it joined. They carry no file data: bytes go from a node's RAM to
the store only.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import redis
import trio
from ckptfs.writeback.backend import Staged
from ckptfs.writeback.journal import FileGen
from ckptfs.writeback.manifest import Digest

from .log import READ_BATCH, SharedLog

if TYPE_CHECKING:
    from ckptfs.writeback.engine import Engine
    from ckptfs.writeback.following import Following

log = logging.getLogger(__name__)

BLOCK_S = 1.0
PROGRESS_EVERY_S = 0.01  # the publishing node's progress, at most this often
KEPT = 200_000  # events kept in the stream (approximately): a node reads them within seconds


class Events:
    """This node's side: it is the engine's `ClusterLink`."""

    def __init__(self, shared: SharedLog, engine: Engine, me: str, publishes: bool) -> None:
        self.shared = shared
        self.key = shared.prefix + "events"
        self.progress_key = shared.prefix + "progress"
        self.engine = engine
        self.me = me
        self.publishes = publishes
        self._out: list[bytes] = []
        self._wake = trio.Event()
        self._last = "$"  # the stream id read up to (set at `start`)
        self._unreachable = False  # an outage of Redis was logged (once)

    # -- ClusterLink ---------------------------------------------------------------
    def staged(self, gen: FileGen) -> None:
        assert gen.staged is not None and gen.digest is not None
        s, d = gen.staged, gen.digest
        self._post({"e": "staged", "ino": gen.ino, "gen": gen.generation,
                    "staged": [s.size, s.token, s.parts, s.at], "digest": [d.size, d.xxh3, list(d.blocks)]})

    def published(self, gen: FileGen, path: str) -> None:
        d = gen.digest
        self._post({"e": "published", "ino": gen.ino, "gen": gen.generation, "path": path,
                    "digest": [d.size, d.xxh3, list(d.blocks)] if d is not None else None})

    def restage(self, gen: FileGen) -> None:
        self._post({"e": "restage", "ino": gen.ino, "gen": gen.generation, "to": gen.owner})

    def _post(self, event: dict) -> None:
        event["by"] = self.me
        self._out.append(json.dumps(event).encode())
        self._wake.set()

    # -- running ---------------------------------------------------------------------
    def start(self) -> None:
        """Read events from now on (before this node makes any). A node
        joining a running cluster also learns how far the publishing node
        got: the journal it replays holds files published long ago."""
        r = self.shared.redis
        last = r.xrevrange(self.key, count=1)
        self._last = last[0][0].decode() if last else "0-0"
        if not self.publishes:
            following: Following = self.engine.publisher  # type: ignore[assignment]
            following.joined(int(r.get(self.progress_key) or 0))

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._send)
            nursery.start_soon(self._receive)
            if self.publishes:
                nursery.start_soon(self._report_progress)
            task_status.started()

    async def _send(self) -> None:
        while True:
            if not self._out:
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            batch, self._out = self._out, []
            try:
                await trio.to_thread.run_sync(self._xadd, batch)
                self._unreachable = False
            except redis.RedisError as exc:
                if not self._unreachable:  # once per outage
                    log.warning("cannot reach the cluster's Redis (%s): telling the other nodes again shortly", exc)
                    self._unreachable = True
                self._out[:0] = batch
                await trio.sleep(0.5)

    def _xadd(self, batch: list[bytes]) -> None:
        pipe = self.shared.redis.pipeline(transaction=False)
        for raw in batch:
            pipe.xadd(self.key, {"e": raw}, maxlen=KEPT, approximate=True)
        if self.publishes:  # where the publishing node got, for nodes that join later (`start`)
            pipe.set(self.progress_key, self._position())
        pipe.execute()

    async def _report_progress(self) -> None:
        reported = -1
        while True:
            change = self.engine.next_change()
            position = self._position()
            if position != reported:
                self._post({"e": "progress", "position": position})
                reported = position
            await change.wait()
            await trio.sleep(PROGRESS_EVERY_S)

    def _position(self) -> int:
        """Every op up to this sequence number is applied to the store."""
        p = self.engine.publisher
        position = p.position
        if p.deferred:
            position = min(position, p.deferred[0][1].seq - 1)
        if self.engine.queue:
            position = min(position, self.engine.queue[0].seq - 1)
        return position

    async def _receive(self) -> None:
        waiter = self.shared.waiter(BLOCK_S)
        while True:
            try:
                got = await trio.to_thread.run_sync(self._xread, waiter, abandon_on_cancel=True)
            except redis.RedisError as exc:
                if not self._unreachable:
                    log.warning("cannot read the cluster's events (%s): trying again", exc)
                    self._unreachable = True
                await trio.sleep(0.5)
                continue
            for eid, raw in got:
                self._last = eid
                try:
                    self._dispatch(json.loads(raw))
                except Exception:
                    log.exception("cannot take in a cluster event: %r", raw[:200])

    def _xread(self, waiter: redis.Redis) -> list[tuple[str, bytes]]:
        got = waiter.xread({self.key: self._last}, count=READ_BATCH, block=int(BLOCK_S * 1000))
        return [(eid.decode(), fields[b"e"]) for eid, fields in got[0][1]] if got else []

    def _dispatch(self, event: dict) -> None:
        if event["by"] == self.me:
            return
        kind, e = event["e"], self.engine
        if kind == "staged" and self.publishes:
            size, token, parts, at = event["staged"]
            e.staged_elsewhere(event["ino"], event["gen"], Staged(size, token, parts, at), _digest(event["digest"]))
        elif kind == "restage" and event["to"] == self.me:
            e.restage(event["ino"], event["gen"])
        elif kind == "published" and not self.publishes:
            e.published_elsewhere(event["ino"], event["gen"], event["path"], _digest(event["digest"]))
        elif kind == "progress" and not self.publishes:
            following: Following = e.publisher  # type: ignore[assignment]
            following.progress(event["position"])


def _digest(raw) -> Digest | None:
    return None if raw is None else Digest(raw[0], raw[1], tuple(raw[2]))
