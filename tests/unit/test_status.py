"""Status totals kept by the Ledger (O(changes)) always equal a full recount;
requests over many files (status --files, evict, prefetch) let the mount
answer meanwhile."""

from __future__ import annotations

import json
import os
import random
import time

import trio
from ckptfs.daemon import control, status
from ckptfs.daemon.status import Ledger, recount
from ckptfs.fs.tree import ROOT
from ckptfs.writeback import residency
from ckptfs.writeback.journal import FileGen
from ckptfs.writeback.publisher import Publisher

from ckptfs.client import PROTOCOL_VERSION
from tests.unit.test_engine import Rig


def _view(t):
    return (t.files, t.by_state, t.in_ram, t.spilled, t.evicted)


async def test_ledger_totals_equal_a_recount_through_a_random_workload(tmp_path):
    rig = Rig(tmp_path / "store")
    ledger = Ledger(rig.store, rig.engine)
    rng = random.Random(5)
    names: list[str] = []
    rig.mkdir("d")
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        for step in range(300):
            op = rng.random()
            if op < 0.35 or not names:
                name = f"d/f{step}" if rng.random() < 0.5 else f"f{step}"
                rig.write(name, os.urandom(rng.randrange(0, 5000)), keep_open=rng.random() < 0.1)
                names.append(name)
            elif op < 0.45:
                rig.unlink(names.pop(rng.randrange(len(names))))
            elif op < 0.55:
                src = names.pop(rng.randrange(len(names)))
                dst = f"r{step}"
                rig.rename(src, dst)
                names.append(dst)
            elif op < 0.62:
                src = names[rng.randrange(len(names))]
                node = rig.store.inode_at(src)
                rig.store.link(node.ino, ROOT, f"l{step}".encode())
                names.append(f"l{step}")
            elif op < 0.72:
                node = rig.store.inode_at(names[rng.randrange(len(names))])
                if not node.writers:
                    if not node.data.resident:
                        await rig.engine.load(node.ino)
                    rig.store.setattr(node.ino, size=rng.randrange(0, 3000))
            elif op < 0.82:
                rig.engine.evict(rng.randrange(0, 20000))
            else:
                await trio.sleep(rng.choice([0, 0.01, 0.05]))
            if step % 10 == 0:
                assert _view(ledger.totals()) == _view(recount(rig.store, rig.engine)), f"step {step}"
        with trio.fail_after(20):
            await rig.engine.flush()
        assert _view(ledger.totals()) == _view(recount(rig.store, rig.engine))
        n.cancel_scope.cancel()


async def test_a_refresh_in_batches_ends_however_many_files_are_in_flight(tmp_path):
    """keep_up refreshes in batches (a restart touches every file), and a
    run of batches ends: files in flight count once each, not as left
    over, or a long write-back queue would keep it busy for ever."""
    rig = Rig(tmp_path / "store")
    ledger = Ledger(rig.store, rig.engine)
    for i in range(30):
        rig.write(f"f{i}", b"x" * 10)  # sealed, not published: the engine is not running
    assert len(rig.engine.unsettled) == 30
    rounds = 0
    while ledger.refresh(limit=7):
        rounds += 1
        assert rounds < 10
    assert rounds == 4  # 30 touched files, 7 at a time
    assert _view(ledger.totals()) == _view(recount(rig.store, rig.engine))


async def test_the_ledger_keeps_up_within_a_second_so_a_query_refreshes_little(tmp_path, autojump_clock):
    """What files made and published touch is counted every second in the
    background: a `status` asked while 2,000 files a second are made and
    published refreshed up to five seconds of them (10,000 files: 37 ms)."""
    rig = Rig(tmp_path / "store")
    ledger = Ledger(rig.store, rig.engine)
    async with trio.open_nursery() as n:
        n.start_soon(ledger.keep_up)
        await trio.sleep(0.1)
        for i in range(20):
            rig.write(f"f{i}", b"x")
        assert rig.store.touched
        await trio.sleep(1.1)
        assert not rig.store.touched and not rig.engine.touched
        assert ledger.sums.files.files == 20
        n.cancel_scope.cancel()


async def _turns_during(body) -> int:
    """How many times another task got a turn while `body` was awaited."""
    turns = 0
    done = False

    async def other() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await trio.sleep(0)

    async with trio.open_nursery() as n:
        n.start_soon(other)
        await trio.sleep(0)
        before = turns
        await body()
        done = True
    return turns - before


async def test_a_long_listing_lets_the_mount_answer_meanwhile(tmp_path, monkeypatch):
    """`status --files` over every file, `evict` and the first totals after a
    restart (every file to count) work in batches, the event loop getting a
    turn between them: over 100,000 files the listing held every request to
    the mount for 2 s (0.7 s of it making the rows). A file removed while
    the listing waited is left out."""
    monkeypatch.setattr(status, "FILES_BATCH", 10)
    monkeypatch.setattr(status, "KEEP_UP_BATCH", 10)
    rig = Rig(tmp_path / "store")
    rig.mkdir("d")
    for i in range(60):
        rig.write(f"d/f{i:02d}", b"x" * i)
    ledger = Ledger(rig.store, rig.engine)
    got = []

    async def listing() -> None:
        got.extend(await status.files(rig.store, rig.engine, "d"))

    async def remove_all_meanwhile() -> None:
        await trio.sleep(0)  # the walk has made one batch or two of its six
        for i in range(60):
            rig.unlink(f"d/f{i:02d}")

    async def both() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(remove_all_meanwhile)
            await listing()

    assert await _turns_during(both) >= 3
    paths = [f.path for f in got]
    assert paths == sorted(paths) and 10 <= len(paths) < 60, "files removed before the walk reached them were listed"
    rig.mkdir("e")
    for i in range(40):
        rig.write(f"e/g{i:02d}", b"y" * i)
    assert await _turns_during(ledger.caught_up) >= 3  # every file written or removed counted, 10 at a time
    assert _view(ledger.totals()) == _view(recount(rig.store, rig.engine))


async def test_a_long_reply_is_the_json_of_its_rows_made_in_batches(tmp_path, monkeypatch):
    """A reply with `Rows` (`status --files`) is encoded a batch at a time,
    the event loop getting a turn between batches, into the same JSON as
    the whole reply encoded at once."""
    monkeypatch.setattr(control, "ROWS_BATCH", 7)
    rows = [{"path": f"d/é{i}\n\"", "size": i, "state": "published"} for i in range(50)]
    message = {"ok": True, "result": {"mount": {"pid": 1}, "files": control.Rows(list(range(50)), lambda i: rows[i]), "totals": {}}}
    line = b""

    async def encode() -> None:
        nonlocal line
        line = await control._line(message)

    assert await _turns_during(encode) >= 7
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {"version": PROTOCOL_VERSION, "ok": True, "result": {"mount": {"pid": 1}, "files": rows, "totals": {}}}
    empty = {"ok": True, "result": {"files": control.Rows([], str)}}
    assert json.loads(await control._line(empty)) == {"version": PROTOCOL_VERSION, "ok": True, "result": {"files": []}}
    plain = {"ok": False, "error": "no"}
    assert await control._line(plain) == json.dumps({"version": PROTOCOL_VERSION, **plain}).encode() + b"\n"


async def test_a_status_query_looks_only_at_files_that_changed(tmp_path, monkeypatch):
    """The totals are refreshed from what changed, files in flight
    included: a generation's change of state touches its file. Every query
    used to count every file in flight again (with 100,000 files queued,
    0.5 s a `status`, the mount waiting)."""
    rig = Rig(tmp_path / "store")
    for i in range(50):
        rig.write(f"f{i}", b"x" * i)  # sealed and queued: the engine is not running yet
    ledger = Ledger(rig.store, rig.engine)
    ledger.totals()
    counted: list[int] = []
    entry = status._ledger_entry
    monkeypatch.setattr(status, "_ledger_entry", lambda engine, inode: counted.append(inode.ino) or entry(engine, inode))
    ledger.totals()
    assert counted == [], "files in flight that did not change were counted again"
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20):
            await rig.engine.flush()
        n.cancel_scope.cancel()
    totals = ledger.totals()
    assert _view(totals) == _view(recount(rig.store, rig.engine))
    assert totals.by_state["published"].files == 50 and len(set(counted)) == 50


async def test_the_totals_of_a_long_queue_look_at_each_queued_file_only_for_what_it_shows(tmp_path, monkeypatch):
    """Each `status` walks the write-back queue once for its length, its
    oldest file and what fails: with 100,000 files queued that took 0.1 s
    a query, the mount waiting, as each file cost a call to tell whether it
    was settled and another whether it was lost (0.04 s now)."""
    rig = Rig(tmp_path / "store")
    for i in range(200):
        rig.write(f"f{i}", b"x")  # sealed and queued: the engine is not running
    first = rig.engine.unsettled[next(iter(rig.engine.unsettled))]
    calls: list[str] = []
    settled = Publisher.settled
    monkeypatch.setattr(Publisher, "settled", lambda self, gen: calls.append("settled") or settled(self, gen))
    lost = FileGen.lost
    monkeypatch.setattr(FileGen, "lost", property(lambda gen: calls.append("lost") or lost.fget(gen)))
    before = time.time()
    totals = Ledger(rig.store, rig.engine).totals()
    assert calls == []
    assert totals.queue == 200 and totals.lost == 0 and totals.failing == 0
    assert before - first.sealed_at <= totals.oldest_unpublished_s <= time.time() - first.sealed_at


async def test_evict_of_many_files_lets_the_mount_answer_meanwhile(tmp_path, monkeypatch):
    """`ckptfs evict` of a whole mount lists its files and evicts them in
    batches, the event loop getting a turn between them."""
    monkeypatch.setattr(status, "FILES_BATCH", 10)
    rig = Rig(tmp_path / "store")
    for i in range(40):
        rig.write(f"f{i:02d}", b"x" * 100)
    server = control.ControlServer(tmp_path / "sock", rig.store, rig.engine, Ledger(rig.store, rig.engine), {"mountpoint": str(tmp_path)})
    result: dict = {}

    async def evict() -> None:
        result.update(await server.evict(""))

    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20):
            await rig.engine.flush()
        assert await _turns_during(evict) >= 6  # 4 batches listed, 4 evicted
        n.cancel_scope.cancel()
    assert result == {"evicted": 40, "bytes": result["bytes"], "refused": []} and result["bytes"] > 0
    assert not any(rig.store.inode_at(f"f{i:02d}").data.resident for i in range(40))


async def test_a_prefetch_of_files_already_in_ram_lets_the_mount_answer_meanwhile(tmp_path, monkeypatch):
    """A prefetch passes files already in RAM without waiting for anything:
    over 100,000 of them it held the event loop for the whole walk."""
    monkeypatch.setattr(residency, "PREFETCH_BATCH", 10)
    rig = Rig(tmp_path / "store")
    for i in range(50):
        rig.write(f"f{i:02d}", b"x" * 100)
    got: list = []

    async def prefetch() -> None:
        got.append(await rig.engine.prefetch(""))

    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20):
            await rig.engine.flush()
        assert await _turns_during(prefetch) >= 4
        n.cancel_scope.cancel()
    assert got == [(0, [])]  # nothing to load: all in RAM
