"""Save and preservation policies on their own (no mount)."""

from __future__ import annotations

from ckptfs.policies import (
    AnyPreservation,
    Checkpoint,
    ContinuousCheckpointing,
    CustomPreservation,
    EveryNSeconds,
    EveryNSteps,
    KeepEveryNSeconds,
    LatestN,
    SaveContext,
    any_of,
)


def ctx(last_step=None, last_time=None, published=True, now=1000.0):
    return SaveContext(last_step, last_time, lambda: published, now)


def cps(*steps_times):
    return [Checkpoint(s, t, f"step-{s}", True) for s, t in steps_times]


def test_save_policies():
    assert [s for s in range(1, 13) if EveryNSteps(4).should_save(s, ctx())] == [4, 8, 12]
    assert not EveryNSteps(4).should_save(8, ctx(last_step=8))
    assert EveryNSeconds(60).should_save(1, ctx())
    assert not EveryNSeconds(60).should_save(2, ctx(1, last_time=950.0))
    assert EveryNSeconds(60).should_save(2, ctx(1, last_time=940.0))
    cc = ContinuousCheckpointing(minimum_interval_secs=10)
    assert cc.should_save(2, ctx(1, 900.0, published=True))
    assert not cc.should_save(2, ctx(1, 900.0, published=False))  # never two in flight
    assert not cc.should_save(2, ctx(1, 995.0, published=True))  # too soon
    assert any_of(EveryNSteps(100), EveryNSeconds(60)).should_save(7, ctx(1, 900.0))


def test_preservation_policies():
    c = cps((1, 0.0), (2, 30.0), (3, 70.0), (4, 90.0), (5, 130.0))
    assert LatestN(2).keep(c) == {4, 5}
    assert LatestN(0).keep(c) == set()
    assert KeepEveryNSeconds(60).keep(c) == {1, 3, 5}  # the first in each minute
    assert AnyPreservation((LatestN(1), KeepEveryNSeconds(60))).keep(c) == {1, 3, 5}
    assert any_of(LatestN(1), CustomPreservation(lambda cs: [x.step for x in cs if x.step % 2 == 0])).keep(c) == {2, 4, 5}
