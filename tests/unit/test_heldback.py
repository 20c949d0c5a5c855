"""How a publishing node's progress names the removals it holds back: as
ranges of journal sequence numbers (`writeback.heldback`)."""

import json

from ckptfs.writeback.heldback import HeldBack


def test_removals_held_back_one_after_another_are_one_range_whatever_lies_between():
    """Behind a parked file every later removal waits: thousands of them
    are one range, whatever other ops lie between them."""
    held = HeldBack.of(range(10, 10_000, 3), [])
    assert held.rows() == [[10, 9997]]
    assert 10 in held and 9997 in held and 500 in held and 9 not in held and 9998 not in held


def test_a_removal_not_held_back_between_two_held_back_ends_a_range():
    """4 had nothing in the store, 8 was applied early (its name taken
    again): neither is held back, and the ranges say so; 1, before the
    first one held back, needs no break."""
    held = HeldBack.of([3, 5, 6, 9, 12], [1, 4, 8])
    assert held.rows() == [[3, 3], [5, 6], [9, 12]]
    assert [seq for seq in range(14) if seq in held] == [3, 5, 6, 9, 10, 11, 12]


def test_a_report_names_at_most_so_many_ranges_and_says_which_removal_it_left_out():
    held = HeldBack.of([1, 3, 5, 7], [2, 4, 6])
    assert held.cut(4) == (held, None)
    shown, left_out = held.cut(2)
    assert shown.rows() == [[1, 1], [3, 3]] and left_out == 5 and shown.first == 1


def test_a_report_of_single_numbers_reads_as_ranges_of_one():
    """How reports named removals before ranges (a cluster's Redis may still hold one)."""
    held = HeldBack([4, 7])
    assert held.rows() == [[4, 4], [7, 7]] and 4 in held and 5 not in held and 7 in held
    assert not HeldBack() and "4" not in held


def test_a_progress_event_names_so_many_ranges_and_redis_keeps_them_all():
    """An event is cut after `WAITING_SENT` ranges, and what follows counts
    as not applied there; the progress Redis keeps names them all, and is
    taken only from the node followed: one that published before it,
    frozen and back, may still write it."""
    from ckptfs.cluster import events

    progress = events.Progress(9, 100_000, [[10 * i, 10 * i + 1] for i in range(1, events.WAITING_SENT + 5)])
    event = events._event_of(progress)
    assert event["cut"] and len(event["waiting"]) == events.WAITING_SENT and event["applied"] == 10 * (events.WAITING_SENT + 1) - 1
    assert "cut" not in events._event_of(progress._replace(waiting=progress.waiting[:3]))
    kept = json.dumps([progress.applied, progress.waiting, "b"]).encode()
    assert events._kept(b"9", kept, "b") == progress and events._kept(b"9", kept, None) == progress
    assert events._kept(b"9", kept, "a") is None and events._kept(None, None, "b") is None
    assert events._kept(b"9", json.dumps([100, []]).encode(), "a") == (9, 100, [])  # written before the node was named
