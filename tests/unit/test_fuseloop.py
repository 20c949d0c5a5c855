"""The turns of pyfuse3's worker tasks at the FUSE device (`daemon.fuseloop`),
with a pipe standing in for the device."""

import os
import threading

import pytest
import trio
from ckptfs.daemon import fuseloop
from ckptfs.daemon.fuseloop import Turns


@pytest.fixture
def waits(monkeypatch):
    """The descriptors waited on through trio's epoll (`wait_readable`), in order."""
    seen = []
    real = trio.lowlevel.wait_readable

    async def counted(fd):
        seen.append(fd)
        await real(fd)

    monkeypatch.setattr(trio.lowlevel, "wait_readable", counted)
    return seen


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    os.close(r)
    os.close(w)


async def _reader(turns: Turns, r: int, order: list, name: str) -> None:
    """What a worker of pyfuse3's loop does: wait, then read one request
    with no checkpoint in between."""
    if await turns.wait():
        order.append((name, os.read(r, 1)))
    else:
        order.append((name, None))


async def test_a_request_queued_already_is_read_without_waiting_on_the_device(pipe, waits):
    r, w = pipe
    turns = Turns(r)
    os.write(w, b"ab")
    order = []
    with trio.fail_after(5):
        await _reader(turns, r, order, "x")
        await _reader(turns, r, order, "x")
        assert order == [("x", b"a"), ("x", b"b")] and waits == []
        async with trio.open_nursery() as nursery:  # an idle device: waited on
            nursery.start_soon(_reader, turns, r, order, "y")
            await trio.testing.wait_all_tasks_blocked()
            assert waits == [r] and len(order) == 2
            os.write(w, b"c")
    assert order[-1] == ("y", b"c")


async def test_a_request_that_comes_while_the_device_is_polled_is_read_without_sleeping_on_it(pipe, waits, monkeypatch):
    """A process making files sends its next request microseconds after the
    last reply: the device is polled a while before the loop sleeps on it."""
    r, w = pipe
    turns = Turns(r)
    monkeypatch.setattr(fuseloop, "SPIN_S", 10.0)  # (ample for the thread below on a loaded machine)
    request = threading.Timer(0.05, os.write, (w, b"a"))
    request.start()
    order = []
    try:
        await _reader(turns, r, order, "x")
    finally:
        request.join()
    assert order == [("x", b"a")] and waits == []
    assert turns.spins == turns.spins_found == 1


async def test_a_poll_that_finds_nothing_lets_the_next_waits_sleep_at_once(pipe, monkeypatch):
    """Requests spaced wider than the spin (a writer computing between
    writes, an idle mount) cost one spin in SPIN_PAUSE + 1 waits, not one
    spin each."""
    r, w = pipe
    turns = Turns(r)
    monkeypatch.setattr(fuseloop, "SPIN_S", 0.001)
    order = []
    n = 2 * (fuseloop.SPIN_PAUSE + 1)
    with trio.fail_after(10):
        for k in range(n):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_reader, turns, r, order, "x")
                await trio.testing.wait_all_tasks_blocked()  # asleep on the idle device
                os.write(w, b"%d" % (k % 10))
    assert [req for _, req in order] == [b"%d" % (k % 10) for k in range(n)]
    assert turns.spins == 2 and turns.spins_found == 0


async def test_other_tasks_run_while_the_device_is_polled(pipe, waits, monkeypatch):
    """A spin holds up no other task: one ready to run takes its turn
    between two polls (here, the very task that sends the request)."""
    r, w = pipe
    turns = Turns(r)
    monkeypatch.setattr(fuseloop, "SPIN_S", 10.0)  # a spin that held the loop would hold the task below that long
    order = []

    async def busy():
        for _ in range(20):
            await trio.lowlevel.checkpoint()
        os.write(w, b"a")

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_reader, turns, r, order, "x")
            nursery.start_soon(busy)
    assert order == [("x", b"a")] and waits == [] and turns.spins_found == 1


async def test_a_stop_while_the_device_is_polled_ends_the_wait(pipe, monkeypatch):
    r, _w = pipe
    turns = Turns(r)
    monkeypatch.setattr(fuseloop.pyfuse3, "terminate", lambda: trio.lowlevel.notify_closing(r))
    monkeypatch.setattr(fuseloop, "SPIN_S", 10.0)
    order = []

    async def stopper():
        for _ in range(5):
            await trio.lowlevel.checkpoint()
        assert turns.spins == 1  # (the reader is polling)
        turns.stop()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_reader, turns, r, order, "x")
            nursery.start_soon(stopper)
    assert order == [("x", None)]


async def test_no_spin_while_another_thread_of_the_daemon_is_at_work(pipe, monkeypatch):
    """A spinning event loop holds the GIL between its polls: a store call's
    thread would wait for it."""
    r, w = pipe
    working = [True]
    turns = Turns(r, busy=lambda: working[0])
    monkeypatch.setattr(fuseloop, "SPIN_S", 10.0)
    order = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_reader, turns, r, order, "x")
            await trio.testing.wait_all_tasks_blocked()  # asleep on the device at once
            os.write(w, b"a")
    assert order == [("x", b"a")] and turns.spins == 0
    working[0] = False
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_reader, turns, r, order, "y")

            async def later():
                for _ in range(5):
                    await trio.lowlevel.checkpoint()
                working[0] = True  # a store call began meanwhile: the spin ends

            nursery.start_soon(later)
            await trio.testing.wait_all_tasks_blocked()
            os.write(w, b"b")
    assert order[-1] == ("y", b"b") and turns.spins == 1 and turns.spins_found == 0


async def test_a_task_cancelled_while_it_polls_the_device_reads_nothing_and_passes_the_turn_on(pipe, monkeypatch):
    """A worker cancelled during its spin (the daemon stopping, say) stops
    at its next poll: it reads no request it could never answer, and the
    next worker takes the turn and reads it."""
    r, w = pipe
    turns = Turns(r)
    monkeypatch.setattr(fuseloop, "SPIN_S", 10.0)
    order = []

    async def cancelled_reader(scope_box):
        with trio.CancelScope() as scope_box[0]:
            await _reader(turns, r, order, "a")

    box = [None]
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancelled_reader, box)
            for _ in range(5):
                await trio.lowlevel.checkpoint()
            assert turns.spins == 1  # ("a" is polling)
            box[0].cancel()
        os.write(w, b"1")
        await _reader(turns, r, order, "b")  # the turn is free: "b" takes it and reads
    assert order == [("b", b"1")]


async def _worker(turns: Turns, r: int, order: list, name: str, busy: dict) -> None:
    """A worker of pyfuse3's loop: wait, read a request, handle it (for as
    long as `busy[name]` is an event not set), again."""
    while await turns.wait():
        order.append((name, os.read(r, 1)))
        if name in busy:
            await busy[name].wait()


async def test_the_task_that_waited_last_goes_next_and_a_new_one_only_when_the_others_are_busy(pipe):
    r, w = pipe
    turns = Turns(r)
    order, busy = [], {}
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for name in "abc":
                nursery.start_soon(_worker, turns, r, order, name, busy)
                await trio.testing.wait_all_tasks_blocked()  # "a" on the device, then "b" and "c", new, parked in order
            for k in range(4):
                os.write(w, b"%d" % k)
                await trio.testing.wait_all_tasks_blocked()
            busy["a"] = busy["b"] = trio.Event()  # "a" and "b" take a while with their next requests
            for k in range(4, 7):
                os.write(w, b"%d" % k)
                await trio.testing.wait_all_tasks_blocked()
            busy["a"].set()
            turns.stopped = True
            nursery.cancel_scope.cancel()
    assert [name for name, _ in order] == ["a", "b", "a", "b", "a", "b", "c"]
    assert [req for _, req in order] == [b"%d" % k for k in range(7)]


async def test_stop_ends_the_task_on_the_device_and_every_one_that_takes_the_turn(pipe, monkeypatch):
    r, w = pipe
    turns = Turns(r)
    monkeypatch.setattr(fuseloop.pyfuse3, "terminate", lambda: trio.lowlevel.notify_closing(r))  # (no FUSE session here)
    order = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for name in "abc":
                nursery.start_soon(_reader, turns, r, order, name)
                await trio.testing.wait_all_tasks_blocked()
            turns.stop()
    assert sorted(order) == [("a", None), ("b", None), ("c", None)]
    os.write(w, b"late")  # a request after the stop is not read
    await _reader(turns, r, order, "d")
    assert order[-1] == ("d", None)


async def test_a_task_cancelled_while_parked_or_on_the_device_does_not_keep_the_turn(pipe):
    r, w = pipe
    turns = Turns(r)
    order, scopes = [], {}

    async def cancellable(name):
        with trio.CancelScope() as scopes[name]:
            await _worker(turns, r, order, name, {})

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for name in "abc":
                nursery.start_soon(cancellable, name)
                await trio.testing.wait_all_tasks_blocked()  # "a" on the device; "b" parked to go next, then "c"
            scopes["b"].cancel()  # parked: it leaves its place
            await trio.testing.wait_all_tasks_blocked()
            os.write(w, b"1")  # "a" reads it and hands the turn to "c"
            await trio.testing.wait_all_tasks_blocked()
            os.write(w, b"2")
            await trio.testing.wait_all_tasks_blocked()  # "c" read it and handed the turn to "a"
            scopes["a"].cancel()  # on the device: it passes the turn on to "c"
            await trio.testing.wait_all_tasks_blocked()
            os.write(w, b"3")
            await trio.testing.wait_all_tasks_blocked()
            turns.stopped = True
            nursery.cancel_scope.cancel()
    assert order == [("a", b"1"), ("c", b"2"), ("c", b"3")]


async def test_a_task_that_takes_the_turn_after_a_stop_with_no_task_waiting_is_told_to_stop(pipe, monkeypatch):
    """pyfuse3's terminate wakes only a task waiting on the device: with all
    of them busy with requests then, the next to take the turn would wait
    on the device for ever."""
    r, _w = pipe
    turns = Turns(r)
    monkeypatch.setattr(fuseloop.pyfuse3, "terminate", lambda: trio.lowlevel.notify_closing(r))
    turns.stop()
    order = []
    with trio.fail_after(5):
        await _reader(turns, r, order, "a")
    assert order == [("a", None)]


def test_install_leaves_pyfuse3_alone_without_a_session(monkeypatch):
    monkeypatch.setattr(fuseloop.pyfuse3, "_wait_fuse_readable", fuseloop.pyfuse3._wait_fuse_readable)
    assert fuseloop.install() is None  # (no FUSE device open in this process)
