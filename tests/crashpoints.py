"""The crash-point workload: what a checkpointing job does while its daemon
is killed (SIGKILL) at its N-th store call (`CKPTFS_TEST_CRASH_AT`), and what
the store may hold after it."""

from __future__ import annotations

import functools
import os
import random
import shutil

from tests.mountutil import run_cli


@functools.cache
def model_bytes(step: int, size: int) -> bytes:
    """The large file of checkpoint `step` (`size` bytes, the same every run)."""
    return random.Random(step).randbytes(size)


def checkpoint_workload(m, big: int = 0) -> None:
    """Two Orbax-style steps, then keep-1 rotation racing the second step's
    write-back (`big`: each step also writes a file of that many bytes,
    `model`); stops quietly once the daemon is gone (every call then fails
    with ENOTCONN)."""
    try:
        for step in (1, 2):
            tmp = m.path(f"{step}.tmp")
            tmp.mkdir()
            for name in ("a", "b", "c"):
                (tmp / name).write_bytes(bytes([step]) * 5000)
            if big:
                (tmp / "model").write_bytes(model_bytes(step, big))
            os.rename(tmp, m.path(str(step)))
            m.path(str(step), "commit").write_text("ok")
            if step == 1:  # published before the next step: every run makes the same first store calls
                run_cli("flush", str(m.mountpoint), "--timeout", "60")
        shutil.rmtree(m.path("1"))
        run_cli("flush", str(m.mountpoint), "--timeout", "60")
    except OSError:
        pass


def consistent(files: dict[str, bytes], step1_was_complete: bool = True, big: int = 0) -> list[str]:
    """What is wrong with `files` as a prefix of the workload's history (none:
    []). Checkpoint 1 may be missing from the start if it was deleted before
    its turn (C4: a file deleted before its turn is never published), so only
    once the store held it complete must it stay until 2 is complete. Every
    file there has its whole bytes."""
    bad = []
    names = ("a", "b", "c", "commit", *(("model",) if big else ()))
    complete = {step for step in ("1", "2") if all(f"{step}/{n}" in files for n in names)}
    for step in ("1", "2"):
        # A marker without its data: only while step 1 is being rotated out (rmtree removes
        # files in directory order, as the mount did), which happens after step 2 is complete.
        if f"{step}/commit" in files and step not in complete and not (step == "1" and "2" in complete):
            bad.append(f"{step}/commit without all of {step}'s data")
    for path, data in files.items():
        step, _, name = path.partition("/")
        if step not in ("1", "2", "1.tmp", "2.tmp"):
            bad.append(f"{path}: no file of the workload")
            continue
        n = int(step[0])
        want = {"commit": b"ok", "model": model_bytes(n, big) if big else None}.get(name, bytes([n]) * 5000)
        if data != want:
            bad.append(f"{path}: {len(data)} bytes, not the {len(want or b'')} written")
    step1 = any(p.startswith(("1/", "1.tmp/")) for p in files)
    step2 = any(p.startswith(("2/", "2.tmp/")) for p in files)
    if step2 and not step1 and "2/commit" not in files and step1_was_complete:
        bad.append("checkpoint 1 removed before checkpoint 2 was complete")
    return bad
