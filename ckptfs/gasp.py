"""Dying gasp (MindIO TTP's idea, for one process): on a fault, save the
last consistent training state before the process goes.

    with DyingGasp(state_fn, save_fn, path, deadline_s=60) as gasp:
        for batch in data:
            loss = model(batch).backward()      # a fault here: state is consistent
            with gasp.update():                 # optimizer.step(): state changes
                optimizer.step()

- A fault *outside* the update section (an exception escaping the loop,
  SIGTERM/SIGINT for preemption) saves `state_fn()`, which then equals the
  state at the start of the current step, waits (up to the deadline) until
  it is published, logs what happened, and re-raises (SIGINT: as
  KeyboardInterrupt; SIGTERM: exits with status 143).
- A signal *inside* the update section is deferred to the section's end.
- An exception *inside* the update section means the state may be torn:
  nothing is saved (the last good checkpoint stays as it is) and the log says
  why.
- A second signal while the gasp waits stops the wait.

Torch-free: `ckptfs.torch.dying_gasp` supplies torch.save and the flush.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("ckptfs.gasp")


class Preempted(BaseException):
    """Raised in the main thread by a signal outside the update section."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


class _Aborted(BaseException):
    pass


class DyingGasp:
    def __init__(self, state_fn: Callable[[], Any], save_fn: Callable[[Any, str], None], path: str, *,
                 deadline_s: float = 60.0, wait_fn: Callable[[str, float], None] | None = None,
                 signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.state_fn = state_fn
        self.save_fn = save_fn
        self.path = path
        self.deadline_s = deadline_s
        self.wait_fn = wait_fn  # wait until `path` is published, within a timeout
        self.signals = signals
        self.outcome = ""  # after a fault: "published", "saved" (not confirmed), "aborted", "failed", "skipped: torn"
        self._old: dict[int, Any] = {}
        self._in_update = False
        self._deferred: int | None = None
        self._torn = False
        self._gasping = False

    def __enter__(self) -> DyingGasp:
        self._old = {s: signal.signal(s, self._on_signal) for s in self.signals}
        return self

    @contextlib.contextmanager
    def update(self) -> Iterator[None]:
        """Wrap the parameter/optimizer update: the state is torn inside."""
        self._in_update = True
        try:
            yield
        except BaseException:
            self._torn = True
            raise
        finally:
            self._in_update = False
        self._torn = False  # a whole update ran: consistent again
        if self._deferred is not None:
            signum, self._deferred = self._deferred, None
            log.warning("dying gasp: %s arrived during the update; handling it now that the update is complete",
                        signal.Signals(signum).name)
            raise Preempted(signum)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._gasping:
            raise _Aborted
        if self._in_update:
            self._deferred = signum
            return
        raise Preempted(signum)

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc is None:
                return False
            if self._torn:
                self.outcome = "skipped: torn"
                log.error("dying gasp: NOT saving: %s was raised inside the update section, so the state may be torn; "
                          "the last good checkpoint is left as it is", exc_type.__name__)
                return False
            self._gasp(exc)
        finally:
            for s, old in self._old.items():
                signal.signal(s, old)
        if isinstance(exc, Preempted):
            if exc.signum == signal.SIGINT:
                raise KeyboardInterrupt from None
            raise SystemExit(128 + exc.signum) from None
        return False

    def _gasp(self, exc: BaseException) -> None:
        why = str(exc) if isinstance(exc, Preempted) else f"{type(exc).__name__}: {exc}"
        t0 = time.monotonic()
        self._gasping = True
        try:
            log.warning("dying gasp: %s; saving the state of the last completed step to %s", why, self.path)
            self.save_fn(self.state_fn(), self.path)
            self.outcome = "saved"
            left = self.deadline_s - (time.monotonic() - t0)
            if self.wait_fn is not None:
                self.wait_fn(self.path, max(0.0, left))
                self.outcome = "published"
            log.warning("dying gasp: %s %s in %.2fs", self.outcome, self.path, time.monotonic() - t0)
        except _Aborted:
            self.outcome = "aborted"
            log.error("dying gasp: a second signal: stopped waiting; %s may not be published", self.path)
        except Exception as e:
            if self.outcome != "saved":  # "saved": the save worked, confirming publication did not
                self.outcome = "failed"
            log.error("dying gasp: %s (%s after %.2fs): %s", "not published" if self.outcome == "saved" else "save failed",
                      self.path, time.monotonic() - t0, e)
        finally:
            self._gasping = False
