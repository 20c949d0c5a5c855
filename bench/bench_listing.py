"""Listing a big directory: `os.listdir` of N empty files in one directory of
the mount (readdir resumed many times) vs the same on /dev/shm. Run as root:

    .venv/bin/python bench/bench_listing.py --files 100000 --rounds 3 --write bench/RESULTS-listing.md
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import emit, machine, median, mounted, timed


def fill(d: Path, n: int) -> None:
    for i in range(n):
        os.close(os.open(d / f"f{i:07d}", os.O_WRONLY | os.O_CREAT, 0o644))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="ckptfs-listing-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="ckptfs-listing-", dir="/dev/shm"))
    t: dict[str, list[float]] = {"mnt": [], "shm": []}
    try:
        with mounted(base) as (mp, _pid):
            (mp / "d").mkdir()
            fill(mp / "d", args.files)
            fill(shm, args.files)
            for _ in range(args.rounds):
                n = 0

                def count(d: Path) -> None:
                    nonlocal n
                    n = len(os.listdir(d))

                t["mnt"].append(timed(lambda: count(mp / "d")))
                assert n == args.files, n
                t["shm"].append(timed(lambda: count(shm)))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    m, r = median(t["mnt"]), median(t["shm"])
    emit([
        "## Listing a big directory",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {machine()}; {args.rounds} rounds, medians.",
        f"Command: `.venv/bin/python bench/bench_listing.py --files {args.files} --rounds {args.rounds}`",
        "",
        "| target | measured | goal | met |",
        "|---|---|---|---|",
        f"| os.listdir of {args.files:,} entries in the mount (seconds) | {m:.2f} s | <= 2 s, linear | {'yes' if m <= 2 else 'no'} |",
        "",
        f"- mount {' '.join(f'{x:.3f}' for x in t['mnt'])} s; /dev/shm {' '.join(f'{x:.3f}' for x in t['shm'])} s "
        f"({m / r:.0f}x /dev/shm)",
    ], args.write)


if __name__ == "__main__":
    main()
