"""The crash-point workload: what a checkpointing job does while its daemon
is killed (SIGKILL) at its N-th store call (`CKPTFS_TEST_CRASH_AT`), and what
the store may hold after it."""

from __future__ import annotations

import functools
import os
import random
import shutil
from collections.abc import Callable

from tests.mountutil import run_cli, start_mount, stop_mount


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


def killed_at_a_store_call(tmp_path, opts: tuple[str, ...], call: str, when: str, big: int,
                           objects: Callable[[], dict[str, bytes]], store: Callable[[], object]) -> None:
    """The workload (`checkpoint_workload`, with a large file of `big`
    bytes) on a mount over the object store `opts` name, its daemon killed
    (SIGKILL) `when` ("before" or "after") its first store call described
    as `call`; then a remount: the store's files (`objects()`: name ->
    bytes) a consistent prefix, `verify` of `store()` clean, and the mount
    publishes the rest and unmounts cleanly."""
    from ckptfs.writeback.verify import verify

    m = start_mount(tmp_path, env={"CKPTFS_TEST_CRASH_AT": f"{call}:{when}"}, extra=opts)
    try:
        checkpoint_workload(m, big)
        assert f"crash-point test: SIGKILL {when} store call" in m.log_text() and f"({call}" in m.log_text()
        # Step 1 whole in the store: its marker was published, after its data (C3). (On object stores its
        # small files may be published at 1.tmp/ and moved: no "published 1/a" line to look for.)
        step1_was_complete = "published 1/commit " in m.log_text()
        assert step1_was_complete  # (every case crashes after step 1's flush)
    finally:
        stop_mount(m)
    again = start_mount(tmp_path, extra=opts)
    again.allowed_log_errors += ["crash-point test"]  # (the killed daemon's line, in the same log)
    try:
        files = objects()
        assert consistent(files, step1_was_complete, big) == [], sorted(files)
        assert verify(store()).clean
        assert run_cli("umount", str(again.mountpoint)).returncode == 0
    finally:
        stop_mount(again)
    assert again.unexpected_log_errors() == []


def killed_after_changes_since_the_image(tmp_path, opts: tuple[str, ...], store: Callable[[], object], n: int = 30) -> None:
    """`n` files published and a clean exit; a daemon that changed two of
    them (f1 rewritten, f2 deleted) then killed (SIGKILL): the mount after it
    reads only the records changed since the image its claim left (f1's and
    the root's; the store's own times tell which), shows the changes, and
    unmounts cleanly over a store `verify` finds clean."""
    import re
    import signal
    import time

    from ckptfs.writeback import manifest
    from ckptfs.writeback.verify import verify

    from tests.storeutil import wait_until

    m = start_mount(tmp_path, extra=opts)
    try:
        # The scan of an empty store has no time, so its image is saved at the
        # first check; the files come after it. Saved while they were written,
        # or just after, it would be the index left at the exit (nothing changed
        # since it), and the records changed within the margin before its time
        # would be read again, rightly.
        wait_until(lambda: "saved the manifest image" in m.log_text(), 30, "the first image")
        for i in range(n):
            m.path(f"f{i}").write_bytes(bytes([i]) * 100)
        assert run_cli("flush", str(m.mountpoint)).returncode == 0
        time.sleep(manifest.CLOCK_MARGIN_S + 1.5)  # records changed within the margin before an image are read again (S3's times: whole seconds)
        assert run_cli("umount", str(m.mountpoint)).returncode == 0
    finally:
        stop_mount(m)
    m = start_mount(tmp_path, extra=opts)
    try:
        m.path("f1").write_bytes(b"new")
        m.path("f2").unlink()
        assert run_cli("flush", str(m.mountpoint)).returncode == 0
        os.kill(m.pid, signal.SIGKILL)
        m.proc.wait(timeout=30)
    finally:
        stop_mount(m)
    again = start_mount(tmp_path, extra=opts)
    again.allowed_log_errors.append("heartbeat")
    try:
        found = re.search(r"reading (\d+) of (\d+) records", again.log_text())
        assert found is not None and int(found[1]) <= 2 and int(found[2]) >= n - 1, (found, _read_again(store()))  # f1's and the root's
        assert sorted(p.name for p in again.mountpoint.iterdir()) == sorted(f"f{i}" for i in range(n) if i != 2)
        assert again.path("f1").read_bytes() == b"new"
        assert again.path("f7").read_bytes() == bytes([7]) * 100
        assert run_cli("umount", str(again.mountpoint)).returncode == 0
    finally:
        stop_mount(again)
    assert manifest.read_all(store())[1] == [] and verify(store()).clean


def _read_again(backend) -> list[tuple[str, str]]:
    """The records a restart reads again over the image in the store, and
    why (to say what a failure of the test above read)."""
    from ckptfs.writeback import manifest
    from ckptfs.writeback.backend import IMAGE

    image = manifest.Image.of_packed(manifest.Image.packed_in(backend, IMAGE), IMAGE)
    if image is None or image.since is None:
        return [("*", "no image with a time")]
    out = []
    for objpath, t in backend.stamped(manifest.PREFIX).items():
        if objpath not in image.objects:
            out.append((objpath, "not in the image"))
        elif t is None or t >= image.since - manifest.CLOCK_MARGIN_S:
            out.append((objpath, f"changed {t} - {image.since}"))
    return out
