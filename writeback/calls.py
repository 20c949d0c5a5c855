"""Every store call the engine makes: in a thread, with a deadline (C11).

A store call that hangs (a dead TCP connection, an S3 server that stops
answering, an NFS mount gone away) must not stall publication, durable
fsyncs or the daemon's exit. Each call runs in its own worker thread; past
its deadline the caller stops waiting and gets `StoreTimeout`, which the
engine retries like any other failure. The thread is *abandoned*: it is left
to finish on its own, holding no limiter slot, and whatever it does late is
fenced by the caller (a staging attempt writes under a name of its own that
nothing publishes once the attempt is given up; see `Engine`).

Uploads, the publisher and loads do not share a limiter: each stage bounds
its own concurrency by its number of tasks, so a 1 KB cold open never waits
behind multi-gigabyte uploads.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import trio

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Deadlines:
    """How long a store call may take: `call_s`, plus `nbytes / min_rate`
    for calls that move data."""

    call_s: float = 60.0
    min_rate: float = 4 << 20  # bytes/s: a 2 GiB upload may take 60 s + 512 s

    def for_bytes(self, nbytes: int) -> float:
        return self.call_s + max(0, nbytes) / self.min_rate


class StoreTimeout(OSError):
    """A store call gave no answer within its deadline (and was abandoned)."""

    def __init__(self, what: str, seconds: float) -> None:
        super().__init__(errno.ETIMEDOUT, f"no answer within {seconds:.0f}s (abandoned)")
        self.what = what


# Errors that retrying cannot fix: the name can never exist in this store, or
# the store refuses the request itself. Anything else (timeouts, connection
# errors, throttling, 5xx, a full disk) is transient and retried.
PERMANENT_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.EINVAL, errno.EILSEQ, errno.EACCES, errno.EPERM, errno.EROFS, errno.ELOOP,
                              errno.EFBIG})


class InTheWay(OSError):
    """Something made in the store by another tool occupies a file's path (a
    directory where the mount has a file, a file where it has a directory):
    permanent until someone moves it."""


def permanent(exc: BaseException) -> bool:
    if isinstance(exc, StoreTimeout):
        return False
    if isinstance(exc, OSError):
        return exc.errno in PERMANENT_ERRNOS or isinstance(exc, PermissionError | InTheWay)
    if isinstance(exc, ValueError | UnicodeError):
        return True
    status = getattr(exc, "response", {}) or {}
    code = status.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) if isinstance(status, dict) else 0
    return 400 <= code < 500 and code not in (408, 429)


class StoreCalls:
    def __init__(self, deadlines: Deadlines = Deadlines()) -> None:
        self.deadlines = deadlines
        # Only so that abandoned threads never exhaust trio's default limiter;
        # concurrency is bounded by the engine's tasks, not here.
        self._threads = trio.CapacityLimiter(10_000)
        self.abandoned = 0
        self.count = 0
        self._stragglers: list[threading.Event] = []  # of abandoned calls: set once their thread is done
        self.crash_at: tuple[int | str, str] | None = None  # the crash-point tests' fault: (call number or what it starts with, "before"/"after")

    async def run(self, what: str, fn: Callable[..., T], *args, nbytes: int = 0, on_end: Callable[[], object] | None = None,
                  scope: trio.CancelScope | None = None) -> T:
        """`fn(*args)` in a thread, within its deadline. `on_end` is called
        in trio when the thread is done, abandoned or not (the publisher
        fences later store changes on the same paths behind a late one).
        `scope`: the caller sets the deadline, later (a call fed while it
        runs)."""
        if on_end is not None:
            fn = _signalling(fn, on_end)
        finished = threading.Event()
        fn = _flagging(fn, finished)
        self.count += 1
        number = self.count
        self._maybe_crash(number, "before", what)
        seconds = self.deadlines.for_bytes(nbytes)
        began = trio.current_time()
        if scope is None:
            scope = trio.move_on_after(seconds)
        with scope:
            try:
                result = await trio.to_thread.run_sync(functools.partial(fn, *args), abandon_on_cancel=True, limiter=self._threads)
            except Exception:
                self._maybe_crash(number, "after", what)  # after a call that failed, too
                raise
            self._maybe_crash(number, "after", what)
            log.debug("store call %s: %.3fs", what, trio.current_time() - began)
            return result
        self.abandoned += 1
        seconds = trio.current_time() - began
        self._stragglers.append(finished)
        log.warning("store call %s gave no answer within %.0fs: abandoned, will be retried", what, seconds)
        raise StoreTimeout(what, seconds)

    @property
    def running(self) -> int:
        """Store calls whose thread is at work now (an abandoned one until it ends)."""
        return self._threads.borrowed_tokens

    def stragglers(self) -> int:
        """Abandoned calls whose thread still runs (and may still change the store)."""
        self._stragglers = [f for f in self._stragglers if not f.is_set()]
        return len(self._stragglers)

    def _maybe_crash(self, number: int, when: str, what: str) -> None:
        if self.crash_at is None or self.crash_at[1] != when:
            return
        at = self.crash_at[0]
        if (at == number) if isinstance(at, int) else what.startswith(at):
            log.warning("crash-point test: SIGKILL %s store call %d (%s)", when, number, what)
            os.kill(os.getpid(), signal.SIGKILL)


def _flagging(fn: Callable[..., T], finished: threading.Event) -> Callable[..., T]:
    def body(*args):
        try:
            return fn(*args)
        finally:
            finished.set()

    return body


def _signalling(fn: Callable[..., T], on_end: Callable[[], object]) -> Callable[..., T]:
    token = trio.lowlevel.current_trio_token()

    def body(*args):
        try:
            return fn(*args)
        finally:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(on_end)  # without waiting for trio to run it

    return body
