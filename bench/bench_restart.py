"""After a restart: how fast the bytes come back from a local store.

- cold `torch.load` of a 2 GiB checkpoint from a fresh mount (nothing in
  RAM, page cache dropped) vs `torch.load` straight from the store directory
  with the page cache dropped, each in a process of its own as a restarted
  trainer is (timed around `torch.load` alone: the tensors it makes are
  fresh memory, as a restarted trainer's are);
- the first 4 KiB of a 3 GiB file from a fresh mount vs reading one block
  (16 MiB, what a load verifies at a time; the first byte waited for one
  until 2026-12-02) straight from the store, both cold, and vs reading
  64 MiB (the block of before 2026-11-29, when the goal was set); and, with
  no goal, vs reading 1 MiB (the file's lead, what is verified before its
  first byte is served since 2026-12-02, in 128 KiB requests: what the
  mount adds to the disk's part); each block read the faster of two ways, in
  8 MiB requests and in 128 KiB ones (on this VM's disk 16 MiB of a cold
  file come in 8-9 ms in small requests, 13-14 ms in large ones: the
  kernel's read-ahead starts small and grows while the reader goes on,
  where one large read waits for all of its bytes); and the whole file, with the daemon's RSS, when
  the RAM budget (1 GiB) is smaller than the file (read in place from the
  store's file, verified; it used to load into the spill directory).

The store side reads twins of the files (the same bytes, beside the store:
the mount does not show them), so that what each side reads has the same
history: a VM's host caches the disk too, below the guest's page cache that
the benchmark drops, and reading the store's file straight after the mount
read it (a file is served in place from it) gave the store a head start.

Rounds are interleaved. Run as root:

    .venv/bin/python bench/bench_restart.py --rounds 3 --write bench/RESULTS-restart.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch
from ckptfs.writeback.manifest import BLOCK
from common import drop_caches, emit, machine, median, mounted, rss_bytes, timed

OLD_BLOCK = 64 << 20  # the block of digests before 2026-11-29 (not imported: `bench/ab.py` runs this over older code too)
SMALL = 128 << 10  # the small requests a block is also read in (what a load's first block is read in since 2026-11-30)
LEAD = 1 << 20  # a file's first bytes verified on their own (not imported: `bench/ab.py` runs this over older code too)


def read_all(path: Path, n: int | None = None, at: int = 0, request: int = 8 << 20) -> None:
    """Read the first `n` bytes (None: all) from offset `at`, `request` bytes at a time."""
    with open(path, "rb", buffering=0) as f:
        f.seek(at)
        left = n if n is not None else 1 << 62
        while left > 0 and (got := len(f.read(min(left, request)))):
            left -= got


LOAD = "import sys, time, torch; t = time.perf_counter(); torch.load(sys.argv[1], map_location='cpu'); print(time.perf_counter() - t)"


def load_fresh(path: Path) -> float:
    """torch.load of `path` in a new process, as a restarted trainer does; its seconds."""
    return float(subprocess.run([sys.executable, "-c", LOAD, str(path)], check=True, capture_output=True, text=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--disk-dir", default="/var/tmp", help="a directory on the plain disk (the store)")
    ap.add_argument("--write")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="ckptfs-restart-", dir=args.disk_dir))
    spill = base / "spill"
    spill.mkdir()
    t: dict[str, list[float]] = {k: [] for k in ("load_mnt", "load_store", "first_mnt", "block_store", "old_block_store",
                                                 "block_store_small", "old_block_store_small", "lead_store", "big_mnt", "big_store")}
    rss: list[int] = []
    try:
        sd = {f"t{i}": torch.randn(25 << 20) for i in range(20)}  # 2 GiB
        with mounted(base, memory_limit="8G") as (mp, _pid):
            torch.save(sd, mp / "ckpt.pt")
            with open(mp / "big.bin", "wb") as f:
                for _ in range(3 * 1024 // 64):
                    f.write(os.urandom(64 << 20))
        del sd
        store = base / "store"
        twin, twin_ckpt = base / "twin.bin", base / "twin.pt"  # beside the store: the mount does not show them
        shutil.copyfile(store / "big.bin", twin)
        shutil.copyfile(store / "ckpt.pt", twin_ckpt)
        for r in range(args.rounds):
            with mounted(base, memory_limit="8G") as (mp, _pid):
                drop_caches()
                t["load_mnt"].append(load_fresh(mp / "ckpt.pt"))
            drop_caches()
            t["load_store"].append(load_fresh(twin_ckpt))
            with mounted(base, memory_limit="1G", extra=("--spill-dir", str(spill))) as (mp, pid):
                drop_caches()
                t["first_mnt"].append(timed(lambda: read_all(mp / "big.bin", 4096)))
                t["big_mnt"].append(timed(lambda: read_all(mp / "big.bin")))
                rss.append(rss_bytes(pid))
            drop_caches()
            t["block_store"].append(timed(lambda: read_all(twin, BLOCK)))
            drop_caches()
            t["old_block_store"].append(timed(lambda: read_all(twin, OLD_BLOCK, at=1 << 30)))  # (not the 16 MiB just read)
            drop_caches()
            t["block_store_small"].append(timed(lambda: read_all(twin, BLOCK, at=2 << 30, request=SMALL)))  # (none of it read yet)
            drop_caches()
            t["old_block_store_small"].append(timed(lambda: read_all(twin, OLD_BLOCK, at=(2 << 30) + (256 << 20), request=SMALL)))
            drop_caches()
            t["lead_store"].append(timed(lambda: read_all(twin, LEAD, at=(2 << 30) + (512 << 20), request=SMALL)))
            drop_caches()
            t["big_store"].append(timed(lambda: read_all(twin)))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in t.items()) + f", rss {rss[-1] >> 20} MiB", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    m = {k: median(v) for k, v in t.items()}
    block, old_block = min(m["block_store"], m["block_store_small"]), min(m["old_block_store"], m["old_block_store_small"])
    load, first, first_old = m["load_mnt"] / m["load_store"], m["first_mnt"] / block, m["first_mnt"] / old_block
    first_lead = m["first_mnt"] / m["lead_store"]
    lines = [
        "## After a restart",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {machine()}; {args.rounds} interleaved rounds, medians.",
        f"Command: `.venv/bin/python bench/bench_restart.py --rounds {args.rounds}`",
        "",
        "| target | measured | goal | met |",
        "|---|---|---|---|",
        f"| cold torch.load of a 2 GiB checkpoint from a fresh mount vs from the store directory, cold, in a new process (time ratio) | {load:.2f}x | <= 1.2x "
        f"| {'yes' if load <= 1.2 else 'no'} |",
        f"| first 4 KiB of a 3 GiB file from a fresh mount vs one {BLOCK >> 20} MiB block from the store, cold, "
        f"read the faster way (time ratio) | {first:.2f}x "
        f"| <= 1x (within one block's fetch) | {'yes' if first <= 1.0 else 'no'} |",
        f"| the same vs {OLD_BLOCK >> 20} MiB from the store (the block of before, when the goal was set) | {first_old:.2f}x "
        f"| <= 1x | {'yes' if first_old <= 1.0 else 'no'} |",
        f"| the same vs {LEAD >> 20} MiB from the store in {SMALL >> 10} KiB requests (the file's lead, what the first byte waits for "
        f"since 2026-12-02) | {first_lead:.2f}x | (none: what the mount adds) | |",
        "",
        f"- torch.load, seconds: mount {' '.join(f'{x:.2f}' for x in t['load_mnt'])}; store {' '.join(f'{x:.2f}' for x in t['load_store'])}",
        f"- first 4 KiB from the mount, seconds: {' '.join(f'{x:.3f}' for x in t['first_mnt'])}; "
        f"{BLOCK >> 20} MiB from the store: {' '.join(f'{x:.3f}' for x in t['block_store'])} in 8 MiB requests, "
        f"{' '.join(f'{x:.3f}' for x in t['block_store_small'])} in {SMALL >> 10} KiB ones; "
        f"{OLD_BLOCK >> 20} MiB: {' '.join(f'{x:.3f}' for x in t['old_block_store'])} and "
        f"{' '.join(f'{x:.3f}' for x in t['old_block_store_small'])}; {LEAD >> 20} MiB: {' '.join(f'{x:.3f}' for x in t['lead_store'])}",
        f"- the whole 3 GiB file with a 1 GiB RAM budget (read in place from the store's file), seconds: mount "
        f"{' '.join(f'{x:.2f}' for x in t['big_mnt'])}; store {' '.join(f'{x:.2f}' for x in t['big_store'])}; "
        f"daemon RSS afterwards {' '.join(f'{x >> 20}' for x in rss)} MiB",
    ]
    emit(lines, args.write)


if __name__ == "__main__":
    main()
