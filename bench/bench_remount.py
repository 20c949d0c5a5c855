"""Restart over many published small files: from `ckptfs mount` until `find`
through the mount lists them all.

- local store (file://), N files of 100 B in directories of 1,000: after a
  clean exit (the manifest index: one object for every record); after a
  crash (kill -9 of a daemon that had claimed the store, which turned the
  index into the manifest image: the records changed since it are read); and with
  neither (one record object read per file), vs `find` over the store
  directory itself in the same round;
- S3 (SeaweedFS on loopback, started and stopped here), M files: the same
  three cases;
- right after the local restart from the index: `status` (the totals) and
  `status --files` (every file), each while another thread lists a
  directory of the mount again and again (the mount must keep serving);
  then `status --files PATH` of one directory of 1,000 files against
  `status --files` of all of them (its cost must follow the prefix).

The store is filled once through a mount (created, flushed, unmounted).
Rounds are interleaved; medians. Run as root:

    .venv/bin/python bench/bench_remount.py --files 100000 --s3-files 10000 --write bench/RESULTS-remount.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ckptfs.writeback.backend import IMAGE
from common import emit, machine, median

from ckptfs import runtime
from ckptfs.client import Client

PER_DIR = 1000
CLI = [sys.executable, "-m", "ckptfs.tools.cli"]


def cli(*args: str) -> None:
    r = subprocess.run([*CLI, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"ckptfs {' '.join(args[:2])} failed: {r.stderr}")


def fill(mp: Path, store: str, n: int, options: list[str]) -> None:
    cli("mount", str(mp), "--store", store, *options)
    try:
        for i in range(n):
            d = mp / f"d{i // PER_DIR:04d}"
            if i % PER_DIR == 0:
                d.mkdir()
            fd = os.open(d / f"f{i:07d}", os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, b"x" * 100)
            os.close(fd)
        Client(mp).flush(timeout=7200)
    finally:
        cli("umount", str(mp))


def crash(mp: Path, store: str, options: list[str]) -> None:
    """A daemon claims the store and is killed (kill -9)."""
    cli("mount", str(mp), "--store", store, *options)
    info = runtime.MountInfo.read(str(mp))
    try:
        os.kill(info.pid, signal.SIGKILL)
        while os.path.exists(f"/proc/{info.pid}"):
            time.sleep(0.01)
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], check=False)


def count(path: Path) -> int:
    out = subprocess.run(["find", str(path), "-type", "f"], capture_output=True, check=True).stdout
    return out.count(b"\n")


def remount(mp: Path, store: str, n: int, options: list[str], then: Callable[[Path], None] | None = None) -> float:
    """Seconds from `ckptfs mount` until `find` lists all n files (then
    `then(mp)`, untimed, before the unmount)."""
    t0 = time.perf_counter()
    cli("mount", str(mp), "--store", store, *options)
    try:
        found = count(mp)
        took = time.perf_counter() - t0
        if then is not None:
            then(mp)
    finally:
        cli("umount", str(mp))  # a clean exit: leaves the index again
    if found != n:
        raise SystemExit(f"the mount listed {found} files, not {n}")
    return took


def status_while_serving(mp: Path, t: dict[str, list[float]]) -> None:
    """`status` (the totals, a client call) and `ckptfs status --files
    --json` (every file) of the mount just restored, each while another thread lists a
    directory of 1,000 files in it again and again: the longest listing
    during each call says whether the mount kept serving."""
    longest, stop = [0.0], threading.Event()

    def lister() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            os.listdir(mp / "d0000")
            longest[0] = max(longest[0], time.perf_counter() - t0)
            time.sleep(0.002)

    c = Client(mp)
    calls = {  # the listing in a process of its own: decoding 20 MiB of JSON here would hold the lister's GIL
        "status": lambda: c.status(),
        "status files": lambda: subprocess.run([*CLI, "status", "--files", "--json", str(mp)], check=True, stdout=subprocess.DEVNULL),
    }
    th = threading.Thread(target=lister)
    th.start()
    try:
        for key, call in calls.items():
            time.sleep(0.2)
            longest[0] = 0.0
            t0 = time.perf_counter()
            call()
            t[key].append(time.perf_counter() - t0)
            time.sleep(0.01)
            t[f"{key} listdir"].append(longest[0])
        time.sleep(0.2)
        longest[0] = 0.0
        time.sleep(1.0)
        t["idle listdir"].append(longest[0])
    finally:
        stop.set()
        th.join()
    # the rows of one directory against every row, both client calls in this process
    for key, path in (("files prefix", mp / "d0000"), ("files all", None)):
        t0 = time.perf_counter()
        rows = c.status(files=True, path=path)["files"]
        t[key].append(time.perf_counter() - t0)
        t[f"{key} rows"].append(len(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--s3-files", type=int, default=10_000, help="0: no S3 rows")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--disk-dir", default="/var/tmp")
    ap.add_argument("--write")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="ckptfs-remount-", dir=args.disk_dir))
    t: dict[str, list[float]] = {k: [] for k in ("local index", "local crash", "local none", "local find", "s3 index", "s3 crash",
                                                 "s3 none", "status", "status listdir", "status files", "status files listdir",
                                                 "idle listdir", "files prefix", "files all", "files prefix rows",
                                                 "files all rows")}
    server = None
    try:
        mp, store = base / "mnt", base / "store"
        mp.mkdir()
        fill(mp, str(store), args.files, [])
        s3_url, s3_opts, s3fs = "", [], None
        if args.s3_files:
            from tests.s3server import start_s3

            server = start_s3(base / "s3")
            s3_url, s3_opts = server.bucket("remount"), server.cli_options()
            s3fs = server._s3fs()
            fill(mp, s3_url, args.s3_files, s3_opts)
        for _ in range(args.rounds):
            t["local index"].append(remount(mp, str(store), args.files, [], then=lambda mp: status_while_serving(mp, t)))
            t0 = time.perf_counter()
            assert count(store) >= args.files
            t["local find"].append(time.perf_counter() - t0)
            crash(mp, str(store), [])
            t["local crash"].append(remount(mp, str(store), args.files, []))
            crash(mp, str(store), [])
            (store / IMAGE).unlink()  # as before the manifest image: every record is read
            t["local none"].append(remount(mp, str(store), args.files, []))
            if s3fs is not None:
                t["s3 index"].append(remount(mp, s3_url, args.s3_files, s3_opts))
                crash(mp, s3_url, s3_opts)
                t["s3 crash"].append(remount(mp, s3_url, args.s3_files, s3_opts))
                crash(mp, s3_url, s3_opts)
                s3fs.rm_file(f"remount/{IMAGE}")
                t["s3 none"].append(remount(mp, s3_url, args.s3_files, s3_opts))
    finally:
        if os.path.ismount(base / "mnt"):
            subprocess.run(["fusermount3", "-u", "-z", str(base / "mnt")])
        if server is not None:
            server.stop()
        shutil.rmtree(base, ignore_errors=True)
    med = {k: median(v) for k, v in t.items() if v}
    n, m = args.files, args.s3_files
    lines = [
        "## Restart over many small files",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {machine()}; {args.rounds} interleaved rounds, medians; page cache warm.",
        f"Command: `.venv/bin/python bench/bench_remount.py --files {n} --s3-files {m} --rounds {args.rounds}`",
        "",
        "| target | measured | goal | met |",
        "|---|---|---|---|",
        f"| `ckptfs mount` until `find` lists {n:,} files, local store, after a clean exit | {med['local index']:.2f} s "
        f"({med['local index'] / med['local find']:.1f}x `find` over the store itself) | <= 3 s | {'yes' if med['local index'] <= 3 else 'no'} |",
    ]
    if m:
        lines.append(f"| the same over S3 (SeaweedFS on loopback), {m:,} files, after a clean exit | {med['s3 index']:.2f} s | <= 3 s | "
                     f"{'yes' if med['s3 index'] <= 3 else 'no'} |")
    ms = {k: med[k] * 1000 for k in ("status", "status listdir", "status files listdir", "idle listdir")}
    share, cost = med["files prefix rows"] / med["files all rows"], med["files prefix"] / med["files all"]
    lines += [
        f"| `status` with {n:,} files, right after the restart (client call) | {ms['status']:.0f} ms | <= 50 ms | "
        f"{'yes' if ms['status'] <= 50 else 'no'} |",
        f"| the mount keeps serving during `ckptfs status --files --json` of all {n:,} files ({med['status files']:.2f} s): longest listing of a "
        f"directory of 1,000 files meanwhile | {ms['status files listdir']:.0f} ms (idle: {ms['idle listdir']:.0f} ms) | (none) | |",
        f"| `status --files PATH` of {share:.1%} of the files (one directory), vs `status --files` of all (client calls; share of the time) "
        f"| {cost:.1%} ({med['files prefix'] * 1000:.0f} ms against {med['files all']:.2f} s) | proportional to the prefix "
        f"(at most twice its share) | {'yes' if cost <= 2 * share else 'no'} |",
        "",
        "- ms, `status`: " + " ".join(f"{x * 1000:.0f}" for x in t["status"]) + "; longest listing meanwhile: "
        + " ".join(f"{x * 1000:.0f}" for x in t["status listdir"]),
        "- seconds, `ckptfs status --files --json`: " + " ".join(f"{x:.2f}" for x in t["status files"]) + "; longest listing meanwhile (ms): "
        + " ".join(f"{x * 1000:.0f}" for x in t["status files listdir"]),
        "- seconds, `status --files PATH` of one directory: " + " ".join(f"{x:.3f}" for x in t["files prefix"]) + "; of all: "
        + " ".join(f"{x:.2f}" for x in t["files all"]),
        "- seconds, local, after a clean exit: " + " ".join(f"{x:.2f}" for x in t["local index"]),
        "- seconds, local, after a crash (from the image its claim left): " + " ".join(f"{x:.2f}" for x in t["local crash"]),
        "- seconds, local, after a crash with no image (one record read per file): " + " ".join(f"{x:.2f}" for x in t["local none"]),
        "- seconds, `find` over the store directory: " + " ".join(f"{x:.2f}" for x in t["local find"]),
    ]
    if m:
        lines += [
            "- seconds, S3, after a clean exit: " + " ".join(f"{x:.2f}" for x in t["s3 index"]),
            "- seconds, S3, after a crash (from the image its claim left): " + " ".join(f"{x:.2f}" for x in t["s3 crash"]),
            "- seconds, S3, after a crash with no image: " + " ".join(f"{x:.2f}" for x in t["s3 none"]),
        ]
    emit(lines, args.write)


if __name__ == "__main__":
    main()
