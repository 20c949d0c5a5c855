"""What the daemon is waiting on: `kill -USR1 <pid>` writes every trio task
with its await stack, every FUSE request being served, how many FUSE
workers wait for the next request, the other coroutines (store calls in
flight on fsspec's event loop), and every thread's stack to the daemon's log.

For a mount that stopped answering while its event loop sits idle: the
stacks name the lock, event or call each request waits for; no request
being served, every worker waiting for the next, says that the kernel
holds the callers, not the daemon."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import traceback
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

import trio

log = logging.getLogger(__name__)

DUMP_SIGNAL = signal.SIGUSR1


def _where(filename: str, lineno: int, name: str) -> str:
    parts = filename.split(os.sep)
    short = os.sep.join(parts[-2:]) if len(parts) > 1 else filename
    return f"{short}:{lineno} {name}"


def _chain(coro: Any) -> Iterator[Any]:
    """`coro` and what it awaits, outermost first (coroutines and the
    generators trio's traps are made of)."""
    while coro is not None:
        yield coro
        coro = getattr(coro, "cr_await", None) if hasattr(coro, "cr_frame") else getattr(coro, "gi_yieldfrom", None)


def _frames(coros: list[Any]) -> list[str]:
    frames = []
    for c in coros:
        frame = getattr(c, "cr_frame", None) or getattr(c, "gi_frame", None)
        if frame is not None:
            frames.append(_where(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
    return frames


_TRIO = ("_core/", "trio/")


def _stack(frames: list[str]) -> str:
    # trio's own layers under the last call of ours say little: the first of them names the wait
    kept = [f for i, f in enumerate(frames) if not f.startswith(_TRIO) or i == 0 or not frames[i - 1].startswith(_TRIO)]
    return " > ".join(kept) or "(running)"


def task_lines(seen: set[int] | None = None) -> list[str]:
    """One line per live trio task, indented under the task whose nursery
    holds it; each names its await stack, outermost call first. The ids of
    the coroutines on those stacks are added to `seen`."""
    lines: list[str] = []

    def walk(task: trio.lowlevel.Task, depth: int) -> None:
        coros = list(_chain(task.coro))
        if seen is not None:
            seen.update(id(c) for c in coros)
        lines.append(f"{'  ' * depth}{task.name}: {_stack(_frames(coros))}")
        for nursery in task.child_nurseries:
            for child in sorted(nursery.child_tasks, key=lambda t: t.name):
                walk(child, depth + 1)

    walk(trio.lowlevel.current_root_task(), 0)
    return lines


class Untasked(NamedTuple):
    requests: list[str]  # FUSE requests being served, each its await stack
    idle_workers: int  # FUSE workers waiting for the next request (or for their turn to read it)
    others: list[str]  # coroutines of other event loops: store calls in flight on fsspec's


def untasked(seen: set[int]) -> Untasked:
    """The await stacks no trio task shows: pyfuse3's workers call each
    request's handler from compiled code, which hides what it awaits, so
    they are found among the live coroutines (those neither awaited by
    another nor in `seen`). A stack with a frame of the FUSE handlers is a
    request; one of trio's alone is a worker waiting in pyfuse3's own code
    (for /dev/fuse, or for the lock that takes turns reading it)."""
    live = [o for o in gc.get_objects() if isinstance(o, types.CoroutineType) and o.cr_frame is not None]
    awaited = {id(c.cr_await) for c in live if c.cr_await is not None}
    requests, idle, others = [], 0, []
    for c in live:
        if id(c) in awaited or id(c) in seen:
            continue
        frames = _frames(list(_chain(c)))
        if any(f.startswith("fs/ops.py") for f in frames):
            requests.append(_stack(frames))
        elif all(f.startswith(_TRIO) for f in frames):
            idle += 1
        else:
            others.append(_stack(frames))
    return Untasked(sorted(requests), idle, sorted(others))


def thread_lines() -> list[str]:
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = []
    for ident, frame in sys._current_frames().items():
        stack = " > ".join(_where(s.filename, s.lineno or 0, s.name) for s in traceback.extract_stack(frame))
        lines.append(f"{names.get(ident, ident)}: {stack}")
    return sorted(lines)


async def dump_on_signal(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
    with trio.open_signal_receiver(DUMP_SIGNAL) as signals:
        task_status.started()
        async for _ in signals:
            seen: set[int] = set()
            tasks = task_lines(seen)
            found, threads = untasked(seen), thread_lines()
            log.info("task dump (%s): %d trio tasks, %d FUSE requests being served, %d FUSE workers waiting for the next request, "
                     "%d other coroutines, %d threads", DUMP_SIGNAL.name, len(tasks), len(found.requests), found.idle_workers,
                     len(found.others), len(threads))
            for line in tasks:  # one record each: the log escapes line breaks inside a record
                log.info("task %s", line)
            for line in found.requests:
                log.info("request %s", line)
            for line in found.others:
                log.info("coroutine %s", line)
            for line in threads:
                log.info("thread %s", line)
            log.info("task dump ends")
