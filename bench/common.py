"""Helpers shared by the benchmarks: mounts, timing, cache control, reports."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@contextmanager
def mounted(base: Path, memory_limit: str = "8G", extra: tuple[str, ...] = ()):
    """A ckptfs mount for the duration of the block; always unmounted."""
    mp, store = base / "mnt", base / "store"
    mp.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "ckptfs.tools.cli", "mount", str(mp), "--store", str(store),
                        "--memory-limit", memory_limit, *extra], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    from ckptfs import runtime

    info = runtime.MountInfo.read(mp)
    try:
        yield mp, info.pid
    finally:
        subprocess.run([sys.executable, "-m", "ckptfs.tools.cli", "umount", str(mp)], capture_output=True)
        if os.path.ismount(mp):
            subprocess.run(["fusermount3", "-u", "-z", str(mp)])


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), "?")
    mem = int(Path("/proc/meminfo").read_text().split()[1]) // (1 << 20)
    return f"{os.cpu_count()} cores ({cpu}), {mem} GiB RAM, kernel {os.uname().release}"


def disk(path: Path) -> str:
    """The file system `path` is on, as far as a benchmark's figures depend
    on it. ext4 without a journal (this VM's disk) skips inodes freed in the
    last minute or more when it makes a file (`recently_deleted` in the
    kernel), walking past each of them: a file made within minutes of many
    removals there costs about 16x (25 us against 392 us a create after 20,000
    removals, on a loop device; with a journal, no difference)."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[2] != dev:
            continue
        rest = fields[fields.index("-") + 1 :]
        fstype, source = rest[0], rest[1]
        if fstype != "ext4":
            return f"{fstype} ({source})"
        try:
            name = Path(f"/sys/dev/block/{dev}").resolve().name
            journal = Path(f"/sys/fs/ext4/{name}/journal_task").read_text().strip() != "<none>"
        except OSError:
            return f"ext4 ({source})"
        return f"ext4 ({source}), {'with' if journal else 'no'} journal"
    return "?"


def emit(lines: list[str], path: str | None) -> None:
    """Print a markdown report and, if asked, write it to `path`."""
    report = "\n".join(lines) + "\n"
    print(report)
    if path:
        Path(path).write_text(report)
