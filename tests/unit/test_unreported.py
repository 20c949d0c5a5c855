"""Which store changes of a cluster's publishing node must wait for its
progress to be reported first (`writeback.unreported`)."""

from __future__ import annotations

from ckptfs.writeback.journal import Attrs, FileGen, Mkdir, Remove, Rename
from ckptfs.writeback.manifest import Meta
from ckptfs.writeback.unreported import Unreported


def _gen(seq: int, name: str) -> FileGen:
    return FileGen(seq, 7, 1, None, Meta(), 0, [name])


def test_a_name_an_unreported_op_changed_waits_for_a_report_until_one_made_after_it_is_sent():
    u = Unreported()
    first = Rename(1, "d", "b", 2, False)
    u.note(("d", "b"), first, made=3, sent=3)
    second = Rename(2, "e", "d", 3, False)
    assert u.conflicts(("e", "d"), second, sent=3)
    assert not u.conflicts(("d", "b"), first, sent=3)  # its own later steps
    assert u.conflicts(("e", "d"), second, sent=4) is False  # report 4, made after it, was sent
    assert not u.conflicts(("x", "y"), second, sent=3)


def test_what_moves_conflicts_above_and_below_it_and_the_rest_only_at_its_name():
    u = Unreported()
    u.note(("run/tmp/shard",), _gen(1, "run/tmp/shard"), made=0, sent=0)
    u.note(("ckpt",), Mkdir(2, "ckpt", 8), made=0, sent=0)
    u.note(("gone",), Remove(3, "gone", 9, False), made=0, sent=0)
    u.note(("meta",), Attrs(4, 10, Meta()), made=0, sent=0)
    later = Rename(5, "run/tmp", "run/step", 11, True)
    assert u.conflicts(("run/tmp", "run/step"), later, sent=0)  # above a file just published
    assert u.conflicts(("run/tmp/shard/x",), later, sent=0)  # below it
    assert not u.conflicts(("ckpt/file",), later, sent=0)  # below a directory made: applied again, harmless
    assert u.conflicts(("ckpt",), later, sent=0)
    assert u.conflicts(("gone",), later, sent=0) and not u.conflicts(("gone/x",), later, sent=0)
    assert u.conflicts(("meta",), _gen(6, "meta"), sent=0)  # a newer generation's record over changed attributes


def test_two_ops_that_changed_one_name_keep_it_unreported_for_the_first_one():
    u = Unreported()
    first, second = _gen(1, "x"), _gen(2, "x")
    u.note(("x",), first, made=0, sent=0)
    u.note(("x",), second, made=0, sent=0)
    assert u.conflicts(("x",), second, sent=0)  # the first's change is not reported either
    u.clear()
    assert not u.conflicts(("x",), second, sent=0)


def test_covered_changes_are_dropped_as_more_are_noted():
    u = Unreported()
    for i in range(10_000):
        u.note((f"f{i}",), _gen(i, f"f{i}"), made=i // 100, sent=i // 100)
    assert len(u._moved) < 5_000
    assert u.conflicts(("f9999",), _gen(10_001, "f9999"), sent=99)
    assert not u.conflicts(("f0",), _gen(10_001, "f0"), sent=99)
