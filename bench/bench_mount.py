"""Save and load speed of a 2 GiB torch checkpoint: ckptfs vs tmpfs vs disk.

Interleaved runs (each round touches every target once, so drift in the
machine hits all of them alike); medians over the rounds. Run as root:

    .venv/bin/python bench/bench_mount.py --rounds 5 --write bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from common import drop_caches, emit, machine, median, mounted, rss_bytes, timed


def state_dict(n: int, mib: int) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": torch.randn(mib * 1024 * 1024 // 4) for i in range(n)}


def save(sd, path: Path, fsync: bool = False) -> None:
    with open(path, "wb") as f:
        torch.save(sd, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def load_touch_mmap(path: Path) -> None:
    sd = torch.load(path, mmap=True, map_location="cpu")
    for t in sd.values():
        t.sum()


def read_file(path: Path, direct: bool = False) -> None:
    """Read a whole file in 8 MiB requests (O_DIRECT: bypassing the page cache)."""
    import mmap

    buf = mmap.mmap(-1, 8 << 20)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        while os.readv(fd, [buf]) > 0:
            pass
    finally:
        os.close(fd)


def longest_stat(path: Path, seconds: float, meanwhile=None) -> float:
    """The longest a `stat` of `path` waits, stat after stat, for `seconds`;
    `meanwhile` runs on this thread at the start of that time."""
    import threading

    stop = threading.Event()
    worst = [0.0]

    def probe() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            os.stat(path)
            worst[0] = max(worst[0], time.perf_counter() - t0)
            time.sleep(0.0005)

    th = threading.Thread(target=probe)
    th.start()
    try:
        if meanwhile is not None:
            meanwhile()
        time.sleep(seconds)
    finally:
        stop.set()
        th.join()
    return worst[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tensors", type=int, default=20)
    ap.add_argument("--tensor-mib", type=int, default=100)
    ap.add_argument("--disk-dir", default="/var/tmp", help="a directory on the plain disk")
    ap.add_argument("--write", help="write the results as markdown to this file")
    args = ap.parse_args()

    sd = state_dict(args.tensors, args.tensor_mib)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    base = Path(tempfile.mkdtemp(prefix="ckptfs-bench-"))
    shm = Path(tempfile.mkdtemp(prefix="ckptfs-bench-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="ckptfs-bench-", dir=args.disk_dir))
    names = ("first_save_mnt", "first_save_shm", "stat_idle", "stat_rm", "save_mnt", "save_shm", "save_disk", "load_mnt", "load_shm", "mmap_mnt",
             "mmap_shm", "read_direct_mnt", "read_cached_mnt", "read_shm")
    t: dict[str, list[float]] = {k: [] for k in names}
    try:
        for r in range(args.rounds):
            # A first save into a fresh daemon, into memory it has never held (what a job's first
            # checkpoint meets), beside the same save into /dev/shm; the daemon's RSS holding it. Then
            # the checkpoint deleted, most of its memory past what the daemon keeps for reuse: how long
            # a stat of another file waits meanwhile, against the same stats with nothing going on.
            with mounted(base / f"fresh{r}", extra=("--reuse-ram", "256M")) as (mp, pid):
                rss0 = rss_bytes(pid)
                t["first_save_mnt"].append(timed(lambda: save(sd, mp / "ckpt.pt")))
                held = (mp / "ckpt.pt").stat().st_size
                rss_fresh = rss_bytes(pid)
                (mp / "probe").write_bytes(b"p")
                t["stat_idle"].append(longest_stat(mp / "probe", 1.0))
                t["stat_rm"].append(longest_stat(mp / "probe", 1.0, meanwhile=lambda: os.unlink(mp / "ckpt.pt")))
            shutil.rmtree(base / f"fresh{r}", ignore_errors=True)
            t["first_save_shm"].append(timed(lambda: save(sd, shm / "first.pt")))
            (shm / "first.pt").unlink()
            print(f"fresh mount {r + 1}: first save {t['first_save_mnt'][-1]:.2f}s, /dev/shm {t['first_save_shm'][-1]:.2f}s; "
                  f"longest stat {t['stat_idle'][-1] * 1000:.1f} ms, while the checkpoint is deleted {t['stat_rm'][-1] * 1000:.1f} ms",
                  flush=True)

        with mounted(base / "main") as (mp, pid):
            for r in range(args.rounds):
                t["save_mnt"].append(timed(lambda: save(sd, mp / "ckpt.pt")))
                t["save_shm"].append(timed(lambda: save(sd, shm / "ckpt.pt")))
                t["save_disk"].append(timed(lambda: save(sd, disk / "ckpt.pt", fsync=True)))
                drop_caches()
                t["load_mnt"].append(timed(lambda: torch.load(mp / "ckpt.pt", map_location="cpu")))
                torch.load(shm / "ckpt.pt", map_location="cpu")  # warm
                t["load_shm"].append(timed(lambda: torch.load(shm / "ckpt.pt", map_location="cpu")))
                drop_caches()
                t["mmap_mnt"].append(timed(lambda: load_touch_mmap(mp / "ckpt.pt")))
                t["mmap_shm"].append(timed(lambda: load_touch_mmap(shm / "ckpt.pt")))
                t["read_direct_mnt"].append(timed(lambda: read_file(mp / "ckpt.pt", direct=True)))
                drop_caches()
                t["read_cached_mnt"].append(timed(lambda: read_file(mp / "ckpt.pt")))
                t["read_shm"].append(timed(lambda: read_file(shm / "ckpt.pt")))
                print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in t.items() if k in names[4:]), flush=True)
            rss_steady = rss_bytes(pid)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)

    m = {k: median(v) for k, v in t.items()}
    gib = nbytes / (1 << 30)
    rss_limit = 1.05 * held + (64 << 20)
    rows = [
        ("the first torch.save into a fresh mount (memory the daemon never held) vs /dev/shm (throughput ratio)",
         f"{m['first_save_shm'] / m['first_save_mnt']:.2f}x", "(none)", None),
        (f"the longest a stat waits while a {gib:.0f} GiB checkpoint is deleted in a fresh mount (past --reuse-ram 256M) vs "
         "while nothing happens (time ratio)",
         f"{m['stat_rm'] / m['stat_idle']:.1f}x ({m['stat_rm'] * 1000:.1f} ms vs {m['stat_idle'] * 1000:.1f} ms)", "(none)", None),
        ("torch.save into the mount vs /dev/shm (throughput ratio)", f"{m['save_shm'] / m['save_mnt']:.2f}x", ">= 1.3x",
         m["save_shm"] / m["save_mnt"] >= 1.3),
        ("torch.save into the mount vs disk + fsync (speed-up)", f"{m['save_disk'] / m['save_mnt']:.2f}x", ">= 3x",
         m["save_disk"] / m["save_mnt"] >= 3),
        ("torch.load cold from the mount / warm /dev/shm (time ratio)", f"{m['load_mnt'] / m['load_shm']:.2f}x", "<= 1.15x",
         m["load_mnt"] / m["load_shm"] <= 1.15),
        ("torch.load(mmap=True) + touch, cold mount / /dev/shm (time ratio)", f"{m['mmap_mnt'] / m['mmap_shm']:.2f}x", "<= 2x",
         m["mmap_mnt"] / m["mmap_shm"] <= 2),
        (f"daemon RSS holding {held / (1 << 30):.2f} GiB (fresh daemon)", f"{rss_fresh / (1 << 20):.0f} MiB",
         f"<= {rss_limit / (1 << 20):.0f} MiB", rss_fresh <= rss_limit),
    ]
    lines = [
        f"## Mount: {gib:.0f} GiB torch checkpoint ({args.tensors} x {args.tensor_mib} MiB float32)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {machine()}; {args.rounds} interleaved rounds, medians.",
        f"Command: `.venv/bin/python bench/bench_mount.py --rounds {args.rounds}`",
        "",
        "| target | measured | goal | met |",
        "|---|---|---|---|",
        *[f"| {name} | {val} | {goal} | {'' if ok is None else 'yes' if ok else 'no'} |" for name, val, goal, ok in rows],
        "",
        "| median seconds | mount | /dev/shm | disk + fsync |",
        "|---|---|---|---|",
        f"| torch.save, the first into a fresh mount | {m['first_save_mnt']:.2f} | {m['first_save_shm']:.2f} | |",
        f"| torch.save | {m['save_mnt']:.2f} | {m['save_shm']:.2f} | {m['save_disk']:.2f} |",
        f"| torch.load (mount cold, shm warm) | {m['load_mnt']:.2f} | {m['load_shm']:.2f} | |",
        f"| torch.load(mmap=True) + touch | {m['mmap_mnt']:.2f} | {m['mmap_shm']:.2f} | |",
        f"| raw read, O_DIRECT (daemon only, no page cache) | {m['read_direct_mnt']:.2f} | | |",
        f"| raw read, cold page cache | {m['read_cached_mnt']:.2f} | {m['read_shm']:.2f} | |",
        "",
        f"Daemon RSS: {rss0 / (1 << 20):.0f} MiB empty, {rss_fresh / (1 << 20):.0f} MiB holding the checkpoint, "
        f"{rss_steady / (1 << 20):.0f} MiB after {args.rounds} overwrites (freed chunks are kept for reuse within the RAM budget).",
        "",
        "Per-round seconds (stat_*: milliseconds): "
        + "; ".join(f"{k}: " + " ".join(f"{x * 1000:.1f}" if k.startswith("stat") else f"{x:.2f}" for x in v) for k, v in t.items()),
    ]
    emit(lines, args.write)


if __name__ == "__main__":
    main()
