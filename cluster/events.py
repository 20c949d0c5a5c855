"""What the write-back engines of a cluster tell each other, through Redis.

One node's publisher applies the cluster's journal to the store (see
`writeback.following`); the others stage their own files and follow it:

- `staged`    a node staged a generation it holds: the publishing node shows it at its turn;
- `restage`   the publishing node cannot show that staged data (gone, or an upload open at a name
              the file has left): its node stages it again, under a hidden key;
- `published` the publishing node showed a generation at a path (its digest with it);
- `progress`  the publishing node applied every op of the journal up to a sequence number
              (`position`), and every op up to a later one (`applied`) but the removals it holds
              back there (`waiting`, as ranges: until the files sealed before them settle; a
              parked or lost file holds them for good);
- `leader`    a node took over publishing (the one that published is gone):
              every node reports again what it has staged and not seen published;
- `lost`      the publishing node lost a node's generation, taking that node for
              gone: the node, if it was only frozen or cut off, hears it too.

Events go through one Redis stream, each node reading all of it from the
moment it joined. They carry no file data: bytes go from a node's RAM to
the store only.

Beside the stream, the publishing node keeps, in the same transaction as
the events before them: its `progress` (the position and what it applied
beyond it, with every range of removals held back, where an event names
256 at most), and the generations it had the turn of and did not publish
(`held`: a completion marker waiting, a parked or lost file). A node
joining reads them, so that it neither takes such a file for published
nor waits for what was applied; a node taking over reads the progress, and
a following node does in place of a progress event that was cut.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, NamedTuple

import redis
import trio
from ckptfs.writeback.backend import Staged
from ckptfs.writeback.following import Following
from ckptfs.writeback.heldback import HeldBack
from ckptfs.writeback.journal import LOST, FileGen
from ckptfs.writeback.manifest import Digest, digest_of_row, digest_row
from ckptfs.writeback.state import State

from .log import READ_BATCH, SharedLog
from .members import LEASE_S

if TYPE_CHECKING:
    from ckptfs.writeback.engine import Engine

log = logging.getLogger(__name__)

BLOCK_S = 1.0
PROGRESS_EVERY_S = 0.01  # the publishing node's progress, at most this often
KEPT = 200_000  # events kept in the stream (approximately): a node reads them within seconds
KEPT_READ_S = 0.1  # a following node reads the progress Redis keeps at most this often (`_read_kept`)
WAITING_SENT = 256  # ranges of removals held back a progress event names at most (after them, nothing counts as applied; Redis's key names all)


class Progress(NamedTuple):
    position: int
    applied: int
    waiting: list[list[int]]  # ranges of removals held back (`heldback.HeldBack`)


class Events:
    """This node's side: it is the engine's `ClusterLink`."""

    def __init__(self, shared: SharedLog, engine: Engine, me: str, publishes: bool, leader: str | None = None) -> None:
        self.shared = shared
        self.key = shared.prefix + "events"
        self.progress_key = shared.prefix + "progress"
        self.applied_key = shared.prefix + "applied"
        self.held_key = shared.prefix + "held"
        self.engine = engine
        self.me = me
        self.publishes = publishes
        self.leader = leader  # whose progress counts (None: anyone's)
        self._out: list[bytes] = []
        # The publishing node's generations whose turn passed unpublished: (ino, generation) -> its row for joiners
        self._held: dict[tuple[int, int], list] = {}
        self._held_changed = False
        self._snapshot: tuple[int, bytes, float] | None = None  # to save (`save_snapshot`)
        self._wake = trio.Event()
        self._last = "$"  # the stream id read up to (set at `start`)
        self._unreachable = False  # an outage of Redis was logged (once)
        self._nursery: trio.Nursery | None = None
        # The publishing node's lease: it changes the store only until then
        # (time.monotonic()), renewed by each heartbeat that keeps its key.
        self.lease_until = time.monotonic() + LEASE_S if publishes else 0.0
        self._lapsed = False  # the lease ran out (logged once)
        self._took_over_at = 0  # the position of the publishing node this one took over from
        self._reported: Progress | None = None  # the progress the last report sent named
        self._report_wanted = False
        self.reports_made = 0  # progress reports made (each taken at one moment, in `_send`)
        self.reports_sent = 0  # the last of them that reached Redis
        self._sent = trio.Event()  # set (and replaced) whenever one does
        self._cut = trio.Event()  # set: `_cut_event`, a progress event heard, was cut (`_read_kept`)
        self._cut_event: dict = {}

    # -- ClusterLink ---------------------------------------------------------------
    def staged(self, gen: FileGen) -> None:
        assert gen.staged is not None and gen.digest is not None
        s, d = gen.staged, gen.digest
        self._post({"e": "staged", "ino": gen.ino, "gen": gen.generation,
                    "staged": [s.size, s.token, s.parts, s.at], "digest": digest_row(d)})

    def published(self, gen: FileGen, path: str) -> None:
        d = gen.digest
        self._post({"e": "published", "ino": gen.ino, "gen": gen.generation, "path": path,
                    "digest": digest_row(d)})

    def restage(self, gen: FileGen) -> None:
        self._post({"e": "restage", "ino": gen.ino, "gen": gen.generation, "to": gen.owner})

    def lost(self, gen: FileGen) -> None:
        self._post({"e": "lost", "ino": gen.ino, "gen": gen.generation, "to": gen.owner, "why": gen.error.removeprefix(LOST)})

    def held(self, gen: FileGen) -> None:
        if gen.state is State.PARKED or (gen.ino, gen.generation) not in self._held:
            self._held[(gen.ino, gen.generation)] = [gen.seq, gen.ino, gen.generation, gen.owner or self.me,
                                                     gen.error if gen.state is State.PARKED else ""]
            self._held_changed = True
            self._wake.set()

    def released(self, gen: FileGen) -> None:
        if self._held.pop((gen.ino, gen.generation), None) is not None:
            self._held_changed = True
            self._wake.set()

    def save_snapshot(self, position: int, blob: bytes, grace_s: float) -> None:
        """Keep `blob` as the namespace's snapshot at log `position` and trim
        the log (`SharedLog.save_snapshot`), with the events before it."""
        self._snapshot = (position, blob, grace_s)
        self._wake.set()

    async def leased(self) -> None:
        """Until this node may change the store: while its lease holds. The
        lease is shorter than the leader key's lifetime in Redis, so a node
        cut off from Redis (or frozen) stops publishing before another node
        can take over."""
        while time.monotonic() >= self.lease_until:
            if not self._lapsed:
                self._lapsed = True
                self.engine.stalled = "this node's lease to publish for the cluster ran out: Redis does not answer its heartbeat"
                log.warning("this node's lease to publish for the cluster ran out (Redis does not answer its heartbeat): publishing waits")
            await trio.sleep(0.1)
        if self._lapsed:
            self._lapsed = False
            self.engine.stalled = ""
            log.info("this node's lease to publish for the cluster is renewed: publishing goes on")

    def renew(self, since: float) -> None:
        """The leader key was kept by a heartbeat sent at `since` (time.monotonic())."""
        self.lease_until = max(self.lease_until, since + LEASE_S)

    def follow(self, leader: str, position: int) -> None:
        """Another node took over publishing from this one (`leader`, at
        `position` now): this node follows it from now on."""
        self.lease_until = 0.0
        self._lapsed = False
        self.engine.stalled = ""
        self.publishes = False
        self.leader = leader
        following = Following(self.engine, self.engine.publisher.markers)
        self.engine.follow(following)
        following.progress(position)
        self._report_staged()

    async def take_over(self, since: float) -> None:
        """This node publishes for the cluster from now on, in place of the
        node that did (gone), its leader key taken at `since` (the lease's
        start): from where that node's progress says it stopped. Every other
        node is told to report again what it staged."""
        self.renew(since)
        following: Following = self.engine.publisher  # type: ignore[assignment]
        last = await until_redis_answers(self.caught_up)  # everything the gone node said, its last progress included
        if last is not None:  # as an event names it, it may leave ranges out
            following.progress(*last)
        self._took_over_at = max(following.leader_position, following.leader_applied)
        self.publishes = True  # what the others stage is this node's to show from now on
        self._took_over_at = await self.engine.take_over()
        self._held_changed = True  # what the gone node held is held again at its turn: the list starts anew
        assert self._nursery is not None
        self._nursery.start_soon(self._report_progress)
        self._post({"e": "leader"})

    def leader_progress(self) -> int:
        """Where the publishing node's progress is (a blocking call)."""
        return int(self.shared.redis.get(self.progress_key) or 0)

    async def caught_up(self) -> Progress | None:
        """Until every event in the stream now has been taken in; returns
        the publishing node's last progress as Redis keeps it beside them
        (None: none yet), which names every range of removals held back."""
        def read() -> list:
            pipe = self.shared.redis.pipeline(transaction=True)  # the progress that the events up to the last one left
            pipe.xrevrange(self.key, count=1)
            pipe.mget([self.progress_key, self.applied_key])
            return pipe.execute()

        last, (position, applied) = await trio.to_thread.run_sync(read)
        target = _id(last[0][0].decode()) if last else (0, 0)
        while _id(self._last) < target:
            await trio.sleep(0.01)
        return _kept(position, applied, self.leader)

    def _post(self, event: dict) -> None:
        self._out.append(self._event(event))
        self._wake.set()

    def _event(self, event: dict) -> bytes:
        event["by"] = self.me
        return json.dumps(event).encode()

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
            position, applied, held = r.mget([self.progress_key, self.applied_key, self.held_key])  # written together: they agree
            kept = _kept(position, applied, None) or Progress(0, 0, [])  # whoever wrote it (a new publishing node may not have yet)
            following.joined(kept.position, json.loads(held) if held else [], kept.applied, kept.waiting)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._send)
            nursery.start_soon(self._receive)
            nursery.start_soon(self._read_kept)
            if self.publishes:
                nursery.start_soon(self._report_progress)
            task_status.started()

    async def reported(self) -> None:
        """Until this node's progress, as it is now, reached Redis (and
        so every node that reads the events)."""
        made = self.reports_made
        self._report_wanted = True
        self._wake.set()
        while self.reports_sent <= made:
            await self._sent.wait()

    async def _send(self) -> None:
        while True:
            if not (self._out or self._held_changed or self._snapshot or self._report_wanted):
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            batch, self._out = self._out, []
            # Where the publishing node got and what it holds, taken at one
            # moment: for the other nodes after the events before it, and for
            # nodes that join later (`start`)
            progress = self._progress() if self.publishes else None
            events, report, self._report_wanted = batch, progress is not None and self._report_wanted, False
            if report:  # at most every PROGRESS_EVERY_S, or at once for `reported`
                self.reports_made += 1
                if progress != self._reported:
                    events = [*batch, self._event(_event_of(progress))]
            made = self.reports_made
            held = None
            if self.publishes and self._held_changed:
                held, self._held_changed = json.dumps(list(self._held.values())).encode(), False
            snapshot, self._snapshot = self._snapshot, None
            try:
                await trio.to_thread.run_sync(self._xadd, events, progress, held, snapshot)
                self._unreachable = False
            except redis.RedisError as exc:
                if not self._unreachable:  # once per outage
                    log.warning("cannot reach the cluster's Redis (%s): telling the other nodes again shortly", exc)
                    self._unreachable = True
                self._out[:0] = batch
                self._report_wanted = self._report_wanted or report
                self._held_changed = self._held_changed or held is not None
                self._snapshot = self._snapshot or snapshot
                await trio.sleep(0.5)
                continue
            if report:
                self._reported, self.reports_sent = progress, made
                self._sent.set()
                self._sent = trio.Event()

    async def _read_kept(self) -> None:
        """On a following node: in place of a progress event that was cut,
        the whole progress, as Redis keeps it (newer: written with the
        event or after it), read at most every KEPT_READ_S; the event's
        own where Redis's is another node's."""
        while True:
            await self._cut.wait()
            self._cut = trio.Event()
            event = self._cut_event
            try:
                position, applied = await trio.to_thread.run_sync(self.shared.redis.mget, [self.progress_key, self.applied_key])
            except redis.RedisError:
                self._cut.set()  # the next try after the pause
            else:
                if not self.publishes and self.leader in (None, event["by"]):
                    following: Following = self.engine.publisher  # type: ignore[assignment]
                    following.progress(*(_kept(position, applied, event["by"]) or
                                         Progress(event["position"], event["applied"], event["waiting"])))
            await trio.sleep(KEPT_READ_S)

    def _xadd(self, batch: list[bytes], progress: Progress | None, held: bytes | None,
              snapshot: tuple[int, bytes, float] | None) -> None:
        pipe = self.shared.redis.pipeline(transaction=True)  # a node joining sees all of it or none
        for raw in batch:
            pipe.xadd(self.key, {"e": raw}, maxlen=KEPT, approximate=True)
        if progress is not None:
            pipe.set(self.progress_key, progress.position)
            pipe.set(self.applied_key, json.dumps([progress.applied, progress.waiting, self.me]))
        if held is not None:
            pipe.set(self.held_key, held)
        if snapshot is not None:
            self.shared.save_snapshot(pipe, *snapshot)
        pipe.execute()

    async def _report_progress(self) -> None:
        while self.publishes:
            change = self.engine.next_change()
            if self._progress() != self._reported:
                self._report_wanted = True
                self._wake.set()
            await change.wait()
            await trio.sleep(PROGRESS_EVERY_S)

    def _progress(self) -> Progress:
        """Every op up to `applied` had its turn at the store (applied; a
        file published, held or parked), but the removals held back
        (`waiting`); `position` is just before the first of those: where a
        node taking over applies the journal from again, but for those
        removals. `applied` is never less than where the node this one took
        over from got: the generations it held come first in the queue
        again, but they had their turn."""
        p = self.engine.publisher
        applied = p.position
        if self.engine.queue:
            applied = min(applied, self.engine.queue[0].seq - 1)
        applied = max(applied, self._took_over_at)
        waiting = p.removals_held(applied)
        position = min(applied, waiting.first - 1) if waiting else applied
        return Progress(position, applied, waiting.rows())

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
        elif kind == "published":  # on a node that published until another took over too
            e.published_elsewhere(event["ino"], event["gen"], event["path"], _digest(event["digest"]))
        elif kind == "progress" and not self.publishes and self.leader in (None, event["by"]):
            following: Following = e.publisher  # type: ignore[assignment]
            if event.get("cut"):  # the whole of it from Redis
                self._cut_event = event
                self._cut.set()
            else:
                following.progress(event["position"], event["applied"], event["waiting"])
        elif kind == "lost" and event["to"] == self.me:
            e.lost_here(event["ino"], event["gen"], event["why"])
        elif kind == "leader" and not self.publishes:
            self.leader = event["by"]  # a node it took over from, frozen and back, no longer counts
            self._report_staged()  # what the old publishing node knew of them went with it

    def _report_staged(self) -> None:
        """Tell the (new) publishing node of every generation this node staged."""
        for gen in list(self.engine.pending.values()):
            if gen.owner is None and gen.state is State.STAGED and gen.staged is not None and gen.staged.token is not None:
                self.staged(gen)


def _id(eid: str) -> tuple[int, int]:
    ms, _, n = eid.partition("-")
    return int(ms), int(n or 0)


def _digest(raw) -> Digest | None:
    return None if raw is None else digest_of_row(raw)


def _event_of(progress: Progress) -> dict:
    """A progress event: it names at most `WAITING_SENT` ranges of removals
    held back (events stay small), and what comes after the last one named
    counts as not applied (`cut`). The progress Redis keeps beside the
    events (`_kept`) names them all: a node joining or taking over reads
    it, and so does a following node when an event is cut (else reads
    there of paths changed after the cut would wait while a file is
    parked)."""
    waiting, left_out = HeldBack(progress.waiting).cut(WAITING_SENT)
    if left_out is None:
        return {"e": "progress", "position": progress.position, "applied": progress.applied, "waiting": waiting.rows()}
    return {"e": "progress", "position": progress.position, "applied": left_out - 1, "waiting": waiting.rows(), "cut": True}


def _kept(position: bytes | None, applied: bytes | None, leader: str | None) -> Progress | None:
    """The progress Redis keeps (the keys `progress` and `applied`), whole;
    None: none yet, or written by a node other than `leader` (when known:
    one that published before it, frozen and back, may still report)."""
    if position is None:
        return None
    beyond, waiting, *by = json.loads(applied) if applied else (int(position), [])
    if leader is not None and by and by[0] != leader:
        return None
    return Progress(int(position), beyond, waiting)


async def until_redis_answers(fn, *args):
    """`fn(*args)`, tried again each second while Redis does not answer."""
    while True:
        try:
            return await fn(*args)
        except redis.RedisError as exc:
            log.warning("cannot reach the cluster's Redis (%s): trying again", exc)
            await trio.sleep(1.0)
