"""Starting and stopping the servers the tests run (S3, GCS, Redis), by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def wait_started(proc: subprocess.Popen, answers: Callable[[], object], timeout: float, stop: Callable[[], None],
                 what: str, log: Path, poll_s: float = 0.2) -> None:
    """Until `answers()` returns (the server is up); if it has not within
    `timeout`, or the server exited, `stop()` and RuntimeError with the end
    of its `log`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            answers()
            return
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                stop()
                raise RuntimeError(f"{what} did not start: {log.read_text()[-2000:] if log.exists() else ''}") from None
            time.sleep(poll_s)


def stop_group(proc: subprocess.Popen | None, timeout: float) -> None:
    """Stop a server started in a session of its own: SIGTERM to its process
    group, SIGKILL if it is not gone within `timeout`."""
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def objects_in(fs, bucket: str) -> dict[str, bytes]:
    """A bucket's objects (ckptfs's own prefix excluded), as a client of its
    fsspec file system `fs` reads them."""
    out = {}
    for full in fs.find(bucket):
        rel = full[len(bucket) + 1 :]
        if not rel.startswith(".ckptfs/"):
            out[rel] = fs.cat_file(full)
    return out
