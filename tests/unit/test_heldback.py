"""How a publishing node's progress names the removals it holds back: as
ranges of journal sequence numbers (`writeback.heldback`)."""

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
