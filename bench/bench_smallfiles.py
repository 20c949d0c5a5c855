"""Many small files: create rate vs /dev/shm, publication rate (with a flush
waiting and without), flush time vs create time, status latency and daemon
memory per file. Run as root:

    .venv/bin/python bench/bench_smallfiles.py --files 10000 --write bench/RESULTS-smallfiles.md
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import disk, drop_caches, emit, machine, median, mounted, rss_bytes, timed

from ckptfs.client import Client

PER_DIR = 1000


def create(root: Path, n: int, payload: bytes, tag: str) -> None:
    (root / tag).parent.mkdir(exist_ok=True)
    for i in range(n):
        d = root / f"{tag}{i // PER_DIR:04d}"
        if i % PER_DIR == 0:
            d.mkdir()
        fd = os.open(d / f"f{i:07d}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        if payload:
            os.write(fd, payload)
        os.close(fd)


def walk(root: Path, n: int, tag: str, read: bool) -> None:
    """`stat` (or read) each of the files `create` made, one after another."""
    for i in range(n):
        p = root / f"{tag}{i // PER_DIR:04d}" / f"f{i:07d}"
        if read:
            with open(p, "rb") as f:
                f.read()
        else:
            os.stat(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--write")
    args = ap.parse_args()
    n = args.files
    base = Path(tempfile.mkdtemp(prefix="ckptfs-small-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="ckptfs-small-", dir="/dev/shm"))
    store_fs = disk(base)
    out: dict = {}
    try:
        with mounted(base) as (mp, pid):
            c = Client(mp)
            rss0 = rss_bytes(pid)
            for label, payload in (("empty", b""), ("100B", b"x" * 100)):
                out[f"shm {label}"] = timed(lambda payload=payload, label=label: create(shm, n, payload, label))
                t0 = time.perf_counter()
                create(mp, n, payload, label)
                out[f"mnt {label}"] = time.perf_counter() - t0
                # status while the files just made are queued and published: each
                # query walks the queue and counts what changed since the last one
                queued: list[int] = []
                out[f"status while queued {label}"] = median(
                    [timed(lambda queued=queued: queued.append(c.status()["totals"]["queue"])) for _ in range(3)])
                out[f"status queued {label}"] = queued[0]
                t1 = time.perf_counter()
                r = c.flush(timeout=3600)
                out[f"flush {label}"] = time.perf_counter() - t1
                out[f"queued {label}"] = r["files"]  # not yet published when the flush began
                out[f"published {label}"] = time.perf_counter() - t0
            out["rss per file"] = (rss_bytes(pid) - rss0) / (2 * n)
            # Write-back with a `flush` waiting on it and without: n more files of
            # 100 B a round, the two kinds of round alternating. Without a flush,
            # `status` is asked until the queue is empty (every 0.25 s, every
            # 0.02 s once fewer than 500 are left: a query costs 10-16 ms with
            # 15,000 queued, under 1 ms with few).
            rates: dict[bool, list[float]] = {False: [], True: []}
            for r in range(2):
                for waited in (False, True):
                    create(mp, n, b"x" * 100, f"{'flushed' if waited else 'polled'}{r}-")
                    t1 = time.perf_counter()
                    if waited:
                        queued = c.flush(timeout=3600)["files"]
                    else:
                        queued = left = c.status()["totals"]["queue"]
                        while left:
                            time.sleep(0.25 if left >= 500 else 0.02)
                            left = c.status()["totals"]["queue"]
                    rates[waited].append(queued / (time.perf_counter() - t1))
            out["rate flushed"], out["rate polled"] = median(rates[True]), median(rates[False])
            out["rates"] = rates
            # The files of 100 B, published and held in the daemon's RAM, looked at
            # again with the kernel's caches dropped (each a request to the daemon:
            # its latency), against the same in /dev/shm.
            for read in (False, True):
                kind = "read" if read else "stat"
                out[f"shm {kind}"] = timed(lambda read=read: walk(shm, n, "100B", read))
                drop_caches()
                out[f"mnt {kind}"] = timed(lambda read=read: walk(mp, n, "100B", read))
            # Orbax: a checkpoint's files written into a temporary directory,
            # renamed once complete (before their turn), then flushed.
            tmp = mp / "ckpt.orbax-checkpoint-tmp-1"
            t0 = time.perf_counter()
            create(tmp.parent, n, b"x" * 100, tmp.name + "/d")  # directories d0000.. under it, PER_DIR files each
            os.rename(tmp, mp / "ckpt")
            out["mnt renamed"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            c.flush(timeout=3600)
            out["flush renamed"] = time.perf_counter() - t1
            # A checkpoint of n small files copied in with `tar x` (which sets
            # each file's owner, mode and times around its close).
            archive = base / "ckpt.tar"
            with tarfile.open(archive, "w") as tar:
                for i in range(n):
                    info = tarfile.TarInfo(f"untarred/d{i // PER_DIR:04d}/f{i:07d}")
                    info.size, info.mode, info.mtime = 100, 0o640, 1_577_836_800 + i
                    tar.addfile(info, io.BytesIO(b"x" * 100))
            t0 = time.perf_counter()
            subprocess.run(["tar", "xf", str(archive), "-C", str(mp)], check=True)
            out["mnt untar"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            c.flush(timeout=3600)
            out["flush untar"] = time.perf_counter() - t1
            # Rotation: that checkpoint removed, then one file written after it.
            t0 = time.perf_counter()
            shutil.rmtree(mp / "ckpt")
            out["mnt rmtree"] = time.perf_counter() - t0
            (mp / "after").write_bytes(b"x")
            t1 = time.perf_counter()
            c.flush(timeout=3600)
            out["flush rmtree"] = time.perf_counter() - t1
            for flag in (False, True):
                ts = []
                for _ in range(5):
                    ts.append(timed(lambda flag=flag: c.status(files=flag)))
                out[f"status files={flag}"] = median(ts)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    lines = [
        "## Many small files",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {machine()}; {n:,} files per kind, {PER_DIR} per directory; store on {store_fs}.",
        f"Command: `.venv/bin/python bench/bench_smallfiles.py --files {n}`",
        "",
        "| target | measured | goal | met |",
        "|---|---|---|---|",
    ]
    for label in ("empty", "100B"):
        r = out[f"mnt {label}"] / out[f"shm {label}"]
        lines.append(f"| create {n:,} files ({label}) vs /dev/shm (time ratio) | {r:.0f}x | <= 25x | {'yes' if r <= 25 else 'no'} |")
    for label in ("empty", "100B"):
        rate = out[f"queued {label}"] / out[f"flush {label}"]
        lines.append(f"| files published per second while `flush` drains the queue ({label}; {out[f'queued {label}']:,.0f} queued) "
                     f"| {rate:,.0f}/s | >= 3,000/s | {'yes' if rate >= 3000 else 'no'} |")
    r = out["rate flushed"] / out["rate polled"]
    lines.append(f"| files of 100 B published per second with `flush` waiting, vs with nobody waiting (rate ratio; medians of "
                 f"{len(out['rates'][True])} rounds each, alternating) | {r:.2f}x | >= 1x (no slower) | {'yes' if r >= 1 else 'no'} |")
    for label in ("empty", "100B"):
        r = out[f"flush {label}"] / out[f"mnt {label}"]
        lines.append(f"| flush after creating them vs the time to create them ({label}) | {r:.2f}x | <= 2x | {'yes' if r <= 2 else 'no'} |")
    r = out["flush renamed"] / out["mnt renamed"]
    lines.append(f"| flush after creating them in a directory renamed before their turn (Orbax), vs the time to create them | {r:.2f}x "
                 f"| <= 2x | {'yes' if r <= 2 else 'no'} |")
    r = out["flush untar"] / out["mnt untar"]
    lines.append(f"| flush after extracting {n:,} files with `tar x` (owners, modes, times set around each close), vs the extraction "
                 f"| {r:.2f}x | <= 2x | {'yes' if r <= 2 else 'no'} |")
    lines.append(f"| flush after removing them (rmtree) and writing one file, vs the rmtree | {out['flush rmtree'] / out['mnt rmtree']:.2f}x "
                 "| (none) | |")
    for kind, what in (("stat", "`stat` of each"), ("read", "reading each")):
        lines.append(f"| {what} of the {n:,} files of 100 B, kernel caches dropped, vs /dev/shm (time ratio) "
                     f"| {out[f'mnt {kind}'] / out[f'shm {kind}']:.0f}x | (none) | |")
    s = out["status files=False"] * 1000
    lines.append(f"| `status` with {2 * n:,} files (client call, ms) | {s:.1f} ms | <= 50 ms | {'yes' if s <= 50 else 'no'} |")
    for label in ("empty", "100B"):
        s = out[f"status while queued {label}"] * 1000
        lines.append(f"| `status` right after creating them ({label}; {out[f'status queued {label}']:,.0f} in the write-back queue), "
                     f"the daemon publishing meanwhile (ms) | {s:.1f} ms | <= 50 ms | {'yes' if s <= 50 else 'no'} |")
    lines += [
        "",
        "- seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in out.items() if not k.startswith(("rss", "status", "queued", "rate"))),
        f"- `status --files` with {2 * n:,} files: {out['status files=True'] * 1000:.0f} ms",
        f"- daemon RSS per file: {out['rss per file'] / 1024:.1f} KiB",
        "- files of 100 B published per second, per round: with `flush` waiting "
        + ", ".join(f"{x:,.0f}" for x in out["rates"][True]) + "; with nobody waiting " + ", ".join(f"{x:,.0f}" for x in out["rates"][False]),
    ]
    if store_fs.endswith("no journal"):
        lines.append("- The store is on ext4 without a journal: there, a file made within a minute or more of many removals "
                     "costs about 16x to make (`common.disk`), so publication right after another run's cleanup is slower.")
    emit(lines, args.write)


if __name__ == "__main__":
    main()
