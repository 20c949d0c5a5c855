"""A cheaper wait for the next FUSE request in pyfuse3's loop.

pyfuse3 (3.3 to 3.5) serves requests with worker tasks that take turns at
/dev/fuse: one at a time waits until the device is readable, reads one
request and handles it, while the next takes the turn. Each wait goes
through trio's epoll: the descriptor registered, a pass of the scheduler,
the registration removed. When requests come back to back (a create is six
of them: LOOKUP, CREATE, the directory's GETATTR, WRITE, FLUSH, RELEASE) the
next one is almost always queued already, and a poll with no timeout tells
so in one system call: the epoll round trip is left for when the device is
idle. Measured side by side (RESULTS-smallfiles.md): creating small files
takes 25-38 % less time, a `stat` 39 %, reading a small file 47 %; large
writes the same.

`Turns.wait` takes the place of pyfuse3's own wait (`install`), which its
loop looks up by name at every request. The turn goes to the task that
waited last, so that a steady stream of requests is served by the same few
tasks (the fastest order, measured) and the others' receive buffers (1 MiB
each, allocated by the first request a task reads) stay untouched:
pyfuse3's count of waiting tasks, which retires idle ones, is not ours to
keep, so its tasks grow to `max_tasks` and stay, and a task new to the
device goes last, to be used only when all the others are busy.
With a pyfuse3 whose loop is not the one this was written against, nothing
is replaced: it runs as shipped.

When nothing is queued yet, the device is polled for `SPIN_S` before the
loop sleeps in epoll, every other task ready to run taking its turn between
two polls: a process that works through files sends its next request within
microseconds of the last reply (`stat`, open, read, close, a create's six
requests), sooner than a thread asleep in epoll wakes on a VM. A spin that
finds nothing makes the next `SPIN_PAUSE` waits sleep at once, so requests
spaced wider than the spin (a writer computing between writes, an idle
mount) cost at most one spin in `SPIN_PAUSE` + 1. There is no spin while
another thread of the daemon is at work (`busy`: a store call, an upload or
a load): the spinning loop holds the GIL between its polls, and a thread
that needs it then waits up to the interpreter's switch interval (0.1 ms
in the daemon, `mount.SWITCH_INTERVAL_S`) each time (a cold `torch.load`
from the mount while its checkpoint was published took 9 % longer). Measured side by side (RESULTS-smallfiles.md,
2026-11-30), on files held in RAM with the kernel's caches dropped: a
`stat` of each of 10,000 files in 0.36-0.45 s where it took 0.63-0.80 s,
reading each in 1.3-1.6 s where it took 2.7-3.4 s; the daemon's CPU time
no higher (a wakeup from epoll costs CPU too).
"""

from __future__ import annotations

import logging
import os
import select
import time
import weakref
from collections.abc import Callable

import pyfuse3
import trio

log = logging.getLogger(__name__)

SPIN_S = 50e-6  # with nothing queued, the device is polled this long (other tasks running between polls) before the loop sleeps
SPIN_PAUSE = 16  # after a spin that found nothing, this many waits go straight to sleep
_SUPPORTED = ((3, 3), (3, 5))  # the pyfuse3 versions (major, minor) whose loop this was written against


class Turns:
    """Which task reads the next request from the FUSE device `fd`: one at a
    time; the others park, and the one that parked last goes next (a task
    that never waited before goes after all the others)."""

    def __init__(self, fd: int, busy: Callable[[], bool] = lambda: False) -> None:
        self.fd = fd
        self._busy = busy  # another thread of the daemon is at work: no spin
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        self._taken = False
        self._parked: list[trio.Event] = []  # the last goes next
        self._seen: weakref.WeakSet[trio.lowlevel.Task] = weakref.WeakSet()  # the tasks that waited before
        self._paused = 0  # waits left that do not spin (`_spun`)
        self.spins = self.spins_found = 0  # spins made, and those that found a request (`ckptfs_fuse_polls_total`)
        self.stopped = False

    async def wait(self) -> bool:
        """Wait for the turn, then until a request can be read: True, or
        False once the loop is to end (`stop`)."""
        await self._take()
        try:
            if not self.stopped and not self._poll.poll(0) and not await self._spun() and not self.stopped:
                await trio.lowlevel.wait_readable(self.fd)
        except trio.ClosedResourceError:  # pyfuse3.terminate() while waiting
            self.stopped = True
        finally:
            self._give()  # the next task runs only once this one has read its request (no checkpoint between)
        return not self.stopped

    async def _spun(self) -> bool:
        """Poll the device for up to `SPIN_S`, every other task ready to
        run taking its turn between two polls: True once a request can be
        read; False (the caller sleeps on the device) if none came, the
        loop is to end, or no spin is due."""
        if self._paused:
            self._paused -= 1
            return False
        if self._busy():
            return False
        self.spins += 1
        poll, clock = self._poll.poll, time.perf_counter
        end = clock() + SPIN_S
        while not self.stopped:
            await trio.lowlevel.checkpoint()  # (a task cancelled meanwhile reads no request)
            if poll(0):
                self.spins_found += 1
                return True
            if clock() >= end or self._busy():
                break
        self._paused = SPIN_PAUSE
        return False

    def stop(self) -> None:
        """End the loop: the task waiting on the device and every task that
        takes the turn from now on are told to stop (pyfuse3's terminate
        wakes only the task waiting on the device)."""
        self.stopped = True
        pyfuse3.terminate()

    async def _take(self) -> None:
        task = trio.lowlevel.current_task()
        new = task not in self._seen
        self._seen.add(task)
        if not self._taken:
            self._taken = True
            try:
                await trio.lowlevel.checkpoint()  # a stream of requests must not starve the other tasks
            except BaseException:
                self._give()
                raise
            return
        handed = trio.Event()
        if new:  # it goes last: it is there for when all the others are busy
            self._parked.insert(0, handed)
        else:
            self._parked.append(handed)
        try:
            await handed.wait()
        except BaseException:
            if handed.is_set():
                self._give()  # handed the turn as it was cancelled: pass it on
            else:
                self._parked.remove(handed)
            raise

    def _give(self) -> None:
        if self._parked:
            self._parked.pop().set()
        else:
            self._taken = False


def install(busy: Callable[[], bool] = lambda: False) -> Turns | None:
    """After `pyfuse3.init`: replace pyfuse3's wait for the next request with
    `Turns.wait`, where pyfuse3's loop is the one this was written against
    and its session's device is found (`busy`: whether another thread of the
    daemon is at work). Returns the turns (stop the loop with their `stop`),
    or None if pyfuse3 is left as it is."""
    try:
        version = tuple(int(p) for p in pyfuse3.__version__.split(".")[:2])
    except (AttributeError, ValueError):
        return None
    if not _SUPPORTED[0] <= version <= _SUPPORTED[1] or not callable(getattr(pyfuse3, "_wait_fuse_readable", None)):
        log.info("pyfuse3 %s: its own wait for requests is used", pyfuse3.__version__)
        return None
    devices = [int(fd) for fd in os.listdir("/proc/self/fd") if _is_fuse_device(int(fd))]
    if len(devices) != 1:  # (one session per daemon)
        log.info("the FUSE device is open %d times in this process: pyfuse3's own wait for requests is used", len(devices))
        return None
    turns = Turns(devices[0], busy)
    pyfuse3._wait_fuse_readable = turns.wait
    log.info("FUSE requests already queued are read without waiting on the event loop (pyfuse3 %s)", pyfuse3.__version__)
    return turns


def _is_fuse_device(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "/dev/fuse"
    except OSError:  # (the listing's own descriptor, closed since)
        return False
