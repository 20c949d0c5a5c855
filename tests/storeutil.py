"""Looking at a store from outside, as a user without ckptfs would."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path

from ckptfs.writeback import manifest
from ckptfs.writeback.backend import open_store
from ckptfs.writeback.verify import verify


def image_in(backend, name: str = manifest.INDEX) -> manifest.Image | None:
    """The manifest image in object `name` of the store (the index, or IMAGE), as a restart reads it."""
    return manifest.Image.of_packed(manifest.Image.packed_in(backend, name), name)


def store_files(store: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, dirnames, names in os.walk(store):
        dirnames[:] = [d for d in dirnames if not (dirpath == str(store) and d == ".ckptfs")]
        for n in names:
            p = os.path.join(dirpath, n)
            with contextlib.suppress(FileNotFoundError):
                out[os.path.relpath(p, store)] = Path(p).read_bytes()
    return out


def wait_until(pred, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def wait_store_matches(store: Path, expected: dict[str, bytes], timeout: float = 60.0) -> None:
    wait_until(lambda: store_files(store) == expected, timeout, f"store to hold {sorted(expected)}")


def verify_store(store: Path):
    return verify(open_store(str(store)))


def begin_outage(store: Path) -> Path:
    """Every write to a local store fails from now on (staging becomes a file)
    until `end_outage`. The daemon may be re-creating the staging directory
    as this runs: it is taken away until the file is in its place."""
    staging = store / ".ckptfs" / "staging"
    for _ in range(1000):
        shutil.rmtree(staging, ignore_errors=True)
        try:
            fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except (FileExistsError, IsADirectoryError):
            continue
        os.write(fd, b"outage")
        os.close(fd)
        return staging
    raise AssertionError("could not take the store's staging directory away")


def end_outage(store: Path) -> None:
    """Writes work again. The daemon, retrying, may make the staging
    directory itself as soon as the file is gone (a directory it finds
    missing is made), so one made meanwhile is no error."""
    staging = store / ".ckptfs" / "staging"
    staging.unlink()
    staging.mkdir(exist_ok=True)


@contextlib.contextmanager
def store_outage(store: Path):
    """Every write to a local store fails while inside (staging is a file)."""
    begin_outage(store)
    try:
        yield
    finally:
        end_outage(store)


class StoreWatcher:
    """Polls a store in a thread; every snapshot must hold only whole files
    matching their manifest records; `check(snapshot)` adds rules."""

    def __init__(self, store: Path, check=None) -> None:
        self.store = store
        self.check = check
        self.polls = 0
        self.error: BaseException | None = None
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StoreWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        assert self.error is None, f"the store watcher died: {self.error!r}"  # it must not stop checking silently

    def _run(self) -> None:
        try:
            self._watch()
        except BaseException as exc:
            self.error = exc

    def _watch(self) -> None:
        backend = None
        while True:
            last = self._stop.is_set()  # one more poll once stopped: the store as the test left it is seen too
            if backend is None and (self.store / ".ckptfs").exists():
                backend = open_store(str(self.store))
            snap = store_files(self.store)  # not kept: a long test would fill RAM
            self.polls += 1
            if backend is not None:
                for path, data in snap.items():
                    if not self._whole(backend, path, data):
                        self.violations.append(f"{path}: {len(data)} bytes match no manifest record")
            if self.check is not None:
                self.violations += self.check(snap)
            if last:
                return
            time.sleep(0.005)

    def _whole(self, backend, path: str, data: bytes) -> bool:
        for _ in range(20):  # the engine may move on between our two reads
            rec = manifest.read(backend, path)
            d = manifest.digest_of([data])
            if rec is not None and rec.matches(d.size, d.xxh3):
                return True
            time.sleep(0.01)
            try:
                data = (self.store / path).read_bytes()
            except FileNotFoundError:
                return True
        return False
