"""Status totals kept by the Ledger (O(changes)) always equal a full recount."""

from __future__ import annotations

import os
import random

import trio
from ckptfs.daemon.status import Ledger, recount
from ckptfs.fs.tree import ROOT

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
    """keep_up refreshes in batches (a restart touches every file); the
    files in flight are looked at by every refresh, and must not count as
    left over, or a long write-back queue would keep it busy for ever."""
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
