"""Mount lifecycle: mount, serve until unmounted or signalled, unmount."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

import pyfuse3
import trio

from ckptfs import runtime
from ckptfs.config import MountConfig

from .memory import MemoryPool
from .ops import Operations
from .store import InodeStore

log = logging.getLogger(__name__)

READ_AHEAD_KB = 4096  # with 1 MiB requests: several in flight while the reader copies


def fuse_options(name: str) -> set[str]:
    options = set(pyfuse3.default_options) | {f"fsname={name}", "subtype=ckptfs"}
    if os.getuid() == 0:
        options.add("allow_other")  # with default_permissions: kernel checks modes
    return options


def serve(config: MountConfig, ready: Callable[[], None] | None = None) -> int:
    """Mount `config.mountpoint`, serve it until unmounted or signalled."""
    store = InodeStore(MemoryPool(config.memory_limit), uid=os.getuid(), gid=os.getgid())
    ops = Operations(store)
    mountpoint = str(config.mountpoint)
    pyfuse3.init(ops, mountpoint, fuse_options(f"ckptfs:{config.store_url}"[:200]))
    info = runtime.MountInfo.new(mountpoint, config.store_url, str(config.log_file or ""))
    try:
        info.write()
        log.info("mounted %s (store %s, RAM budget %d bytes)", mountpoint, config.store_url, config.memory_limit)
        trio.run(_main, mountpoint, ready)
    finally:
        pyfuse3.close(unmount=True)
        runtime.remove(mountpoint)
        log.info("unmounted %s", mountpoint)
    return 0


async def _main(mountpoint: str, ready: Callable[[], None] | None) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signal)
        nursery.start_soon(_when_live, mountpoint, ready)
        # Idle workers are kept: each new one would malloc a fresh 1 MiB buffer.
        await pyfuse3.main(min_tasks=8, max_tasks=64)
        nursery.cancel_scope.cancel()  # unmounted from outside (fusermount3 -u)


async def _when_live(mountpoint: str, ready: Callable[[], None] | None) -> None:
    """Once the kernel has finished INIT, tune the mount and report it live."""
    # Any request through the mount is answered only after INIT; INIT also
    # clamps read-ahead, so it can only be raised afterwards.
    await trio.to_thread.run_sync(os.stat, mountpoint)
    _set_read_ahead(mountpoint)
    if ready is not None:
        ready()


async def _stop_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("received %s, unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


def _set_read_ahead(mountpoint: str) -> None:
    # Not os.stat(): the mount cannot answer before the main loop runs.
    dev = _mount_device(mountpoint)
    if dev is None:
        return
    path = f"/sys/class/bdi/{dev}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(READ_AHEAD_KB))
    except OSError as exc:
        log.debug("cannot set read-ahead via %s: %s", path, exc)


def _mount_device(mountpoint: str) -> str | None:
    """The "major:minor" of the mount at `mountpoint` (the newest one there)."""
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4].replace("\\040", " ") == mountpoint:
                found = fields[2]
    return found
