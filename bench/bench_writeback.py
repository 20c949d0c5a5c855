"""Write-back speed: how soon a save is durable, S3 throughput, and what
continuous checkpointing costs a training loop. Run as root:

    .venv/bin/python bench/bench_writeback.py --rounds 3 --write bench/RESULTS-writeback.md
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
from common import emit, machine, median, mounted


def wait_file(path: Path, size: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.stat().st_size == size):
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} was not published")
        time.sleep(0.005)


def time_to_durable(rounds: int, disk: Path) -> dict[str, list[float]]:
    """A 2 GiB torch.save into the mount: until it returns and until the
    store has the file; the references: the same save into /dev/shm, and
    `cp` + fsync of its bytes to the store's disk."""
    sd = {f"t{i}": torch.randn(25 << 20) for i in range(20)}  # 2 GiB
    t: dict[str, list[float]] = {"save": [], "durable": [], "shm_save": [], "cp_fsync": []}
    base = Path(tempfile.mkdtemp(prefix="wb-", dir=disk))
    try:
        with mounted(base, memory_limit="6G") as (mp, _pid):
            for r in range(rounds):
                target = base / "store" / f"ckpt{r}.pt"
                t0 = time.perf_counter()
                torch.save(sd, mp / f"ckpt{r}.pt")
                t["save"].append(time.perf_counter() - t0)
                size = (mp / f"ckpt{r}.pt").stat().st_size
                wait_file(target, size)
                t["durable"].append(time.perf_counter() - t0)
                os.unlink(mp / f"ckpt{r}.pt")

                shm = Path("/dev/shm") / f"ref{r}.pt"
                dst = base / f"ref{r}.pt"
                t0 = time.perf_counter()
                torch.save(sd, shm)
                t1 = time.perf_counter()
                shutil.copyfile(shm, dst)
                fd = os.open(dst, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
                t["shm_save"].append(t1 - t0)
                t["cp_fsync"].append(time.perf_counter() - t1)
                shm.unlink()
                dst.unlink()
                print(f"durable round {r + 1}: mount save {t['save'][-1]:.2f}s, durable {t['durable'][-1]:.2f}s; "
                      f"shm save {t['shm_save'][-1]:.2f}s, cp+fsync {t['cp_fsync'][-1]:.2f}s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return t


def wait_object(fs, key: str, size: int, timeout: float = 600.0) -> None:
    """Until the object `key` is visible in full (publication is atomic)."""
    deadline = time.monotonic() + timeout
    while True:
        fs.invalidate_cache()
        try:
            if fs.info(key)["size"] == size:
                return
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(key)
        time.sleep(0.05)


def s3_throughput(rounds: int) -> tuple[list[float], list[float], int]:
    import s3fs

    from tests.s3server import start_s3

    root = Path(tempfile.mkdtemp(prefix="wb-s3-", dir="/var/tmp"))
    server = start_s3(root / "s3")
    files = {f"shard{i}.bin": os.urandom(128 << 20) for i in range(4)}
    nbytes = sum(len(v) for v in files.values())
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.options())
    mnt_t, ref_t = [], []
    try:
        for r in range(rounds):
            url = server.bucket(f"wb{r}")
            with mounted(root / f"m{r}", memory_limit="4G", extra=("--store", url, *server.cli_options())) as (mp, _pid):
                t0 = time.perf_counter()
                for name, data in files.items():
                    (mp / name).write_bytes(data)
                for name, data in files.items():
                    wait_object(fs, f"wb{r}/{name}", len(data))
                mnt_t.append(time.perf_counter() - t0)
            src = Path("/dev/shm") / "wb-src"
            src.mkdir(exist_ok=True)
            for name, data in files.items():
                (src / name).write_bytes(data)
            server.bucket(f"ref{r}")
            t0 = time.perf_counter()
            for name in files:
                fs.put_file(str(src / name), f"ref{r}/{name}")
            ref_t.append(time.perf_counter() - t0)
            shutil.rmtree(src)
            print(f"s3 round {r + 1}: ckptfs {nbytes / mnt_t[-1] / 1e6:.0f} MB/s, s3fs put_file {nbytes / ref_t[-1] / 1e6:.0f} MB/s", flush=True)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    return mnt_t, ref_t, nbytes


def s3_one_file(rounds: int) -> tuple[list[float], list[float], int]:
    """One 2 GiB file: ckptfs from the start of its write until it is
    published (it is staged while written), vs writing the same bytes to
    /dev/shm, then s3fs `put_file` with ckptfs's part size and part
    concurrency."""
    import s3fs
    from ckptfs.writeback.objectstore import PART_CONCURRENCY, PART_SIZE

    from tests.s3server import start_s3

    root = Path(tempfile.mkdtemp(prefix="wb-s3one-", dir="/var/tmp"))
    server = start_s3(root / "s3")
    data = os.urandom(1 << 30) * 2
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.options())
    src = Path("/dev/shm") / "wb-one.bin"
    mnt_t, ref_t = [], []
    try:
        for r in range(rounds):
            url = server.bucket(f"one{r}")
            with mounted(root / f"m{r}", memory_limit="6G", extra=("--store", url, *server.cli_options())) as (mp, _pid):
                t0 = time.perf_counter()
                with open(mp / "big.bin", "wb") as f:
                    f.write(data)
                wait_object(fs, f"one{r}/big.bin", len(data))
                mnt_t.append(time.perf_counter() - t0)
            server.bucket(f"oneref{r}")
            t0 = time.perf_counter()
            src.write_bytes(data)
            fs.put_file(str(src), f"oneref{r}/big.bin", chunksize=PART_SIZE, max_concurrency=PART_CONCURRENCY)
            ref_t.append(time.perf_counter() - t0)
            src.unlink()
            print(f"s3 one file round {r + 1}: ckptfs {len(data) / mnt_t[-1] / 1e6:.0f} MB/s, "
                  f"s3fs put_file {len(data) / ref_t[-1] / 1e6:.0f} MB/s", flush=True)
    finally:
        src.unlink(missing_ok=True)
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    return mnt_t, ref_t, len(data)


def training(steps: int, every: int, disk: Path, rounds: int) -> dict[str, list]:
    """Steps/s of one loop, saving its full state every `every` steps into
    the mount, into /dev/shm, to the disk with fsync, and not saving: each
    round runs every variant once, on one mount, in an order rotated from
    round to round and reversed every other round (no variant always runs
    first, last, or before another)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2560, 2560) for _ in range(4)])  # ~26M params, 105 MiB
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(32, 2560)

    def loop(save) -> float:
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if save is not None and step % every == 0:
                save(step)
        return steps / (time.perf_counter() - t0)

    def rotating(d: Path):
        def save(step: int) -> None:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, d / f"step{step}.pt")
            if step > 2 * every:
                os.unlink(d / f"step{step - 2 * every}.pt")
        return save

    def clear(d: Path) -> None:
        for p in d.glob("*.pt"):
            p.unlink()

    out: dict[str, list] = {"none": [], "ckptfs": [], "shm": [], "disk+fsync": []}
    published: list[str] = []
    loop(None)  # warm up: the first loop of a process is the slowest
    base = Path(tempfile.mkdtemp(prefix="wb-train-", dir=disk))
    shm = Path(tempfile.mkdtemp(prefix="wb-train-", dir="/dev/shm"))
    try:
        with mounted(base, memory_limit="4G") as (mp, _pid):
            def to_disk(step: int) -> None:
                with open(base / f"disk{step}.pt", "wb") as f:
                    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
                    f.flush()
                    os.fsync(f.fileno())
                if step > 2 * every:
                    os.unlink(base / f"disk{step - 2 * every}.pt")

            variants = {"none": None, "ckptfs": rotating(mp), "shm": rotating(shm), "disk+fsync": to_disk}
            names = list(variants)
            for r in range(rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order if r % 2 == 0 else order[::-1]:
                    out[name].append(loop(variants[name]))
                    if name == "ckptfs":  # its last write-back must not run into the next loop's time
                        subprocess.run([sys.executable, "-m", "ckptfs.tools.cli", "flush", str(mp), "--timeout", "600"], check=True,
                                       capture_output=True)
                        published = sorted(p.name for p in (base / "store").glob("*.pt"))
                clear(mp)
                clear(shm)
                for p in base.glob("disk*.pt"):
                    p.unlink()
                print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in out.items()) + " steps/s", flush=True)
        out["published"] = published
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    return out


def row(name: str, ratio: float, goal: str, met: bool) -> str:
    return f"| {name} | {ratio:.2f}x | {goal} | {'yes' if met else 'no'} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--disk-dir", default="/var/tmp")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--parts", default="durable,s3,s3one,train", help="which measurements to run")
    ap.add_argument("--write")
    args = ap.parse_args()
    disk = Path(args.disk_dir)
    parts = set(args.parts.split(","))
    lines = [
        "## Write-back",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {machine()}; {args.rounds} interleaved rounds, medians.",
        f"Command: `.venv/bin/python bench/bench_writeback.py --rounds {args.rounds} --parts {args.parts}`",
        "",
        "| target | measured | goal | met |",
        "|---|---|---|---|",
    ]
    details = []
    if "durable" in parts:
        t = time_to_durable(args.rounds, disk)
        r = median(t["durable"]) / (median(t["shm_save"]) + median(t["cp_fsync"]))
        lines.append(row("2 GiB torch.save until published to file:// on disk, vs /dev/shm save + cp + fsync (time ratio)", r, "<= 1.15x", r <= 1.15))
        r = median(t["durable"]) / max(median(t["save"]), median(t["cp_fsync"]))
        lines.append(row("the same, vs the longer of: the save into the mount alone, cp + fsync of its bytes to the store's disk (time ratio)",
                         r, "<= 1.1x", r <= 1.1))
        details.append("- seconds: " + "; ".join(f"{k.replace('_', ' ')} {' '.join(f'{x:.2f}' for x in v)}" for k, v in t.items()))
    if "s3" in parts:
        s3_mnt, s3_ref, s3_bytes = s3_throughput(args.rounds)
        r = median(s3_ref) / median(s3_mnt)
        lines.append(row("write-back to s3:// (SeaweedFS on loopback) vs s3fs put_file (throughput ratio)", r, ">= 0.8x", r >= 0.8))
        details.append(f"- S3, {s3_bytes >> 20} MiB in 4 files: ckptfs {' '.join(f'{s3_bytes / x / 1e6:.0f}' for x in s3_mnt)} MB/s; "
                       f"s3fs put_file {' '.join(f'{s3_bytes / x / 1e6:.0f}' for x in s3_ref)} MB/s")
    if "s3one" in parts:
        from ckptfs.writeback.objectstore import PART_CONCURRENCY, PART_SIZE

        one_mnt, one_ref, one_bytes = s3_one_file(args.rounds)
        r = median(one_ref) / median(one_mnt)
        lines.append(row(f"one 2 GiB file written and published to s3:// vs written to /dev/shm then s3fs put_file, both {PART_SIZE >> 20} MiB parts, "
                         f"{PART_CONCURRENCY} in flight (throughput ratio)", r, ">= 0.9x", r >= 0.9))
        details.append(f"- S3, one {one_bytes >> 20} MiB file: ckptfs {' '.join(f'{one_bytes / x / 1e6:.0f}' for x in one_mnt)} MB/s; "
                       f"s3fs put_file {' '.join(f'{one_bytes / x / 1e6:.0f}' for x in one_ref)} MB/s")
    if "train" in parts:
        tr = training(args.steps, 10, disk, args.rounds)
        m = {k: median(tr[k]) for k in ("none", "ckptfs", "shm", "disk+fsync")}
        r = m["ckptfs"] / m["none"]
        lines.append(row("training loop saving every 10 steps into the mount vs not saving (steps/s ratio)", r, ">= 0.8x", r >= 0.8))
        r = m["ckptfs"] / m["shm"]
        paired = median([a / b for a, b in zip(tr["ckptfs"], tr["shm"], strict=True)])
        lines.append(f"| the same loop saving into the mount vs saving into /dev/shm (steps/s ratio: of the medians; the median of each "
                     f"round's ratio) | {r:.2f}x; {paired:.2f}x | >= 1x | {'yes' if r >= 1 and paired >= 1 else 'no'} |")
        details.append(f"- training (26M-parameter MLP + Adam, ~315 MiB per checkpoint, {args.steps} steps; each round runs every loop once, "
                       f"in an order rotated from round to round and reversed every other round), steps/s: "
                       + "; ".join(f"{k} {' '.join(f'{x:.2f}' for x in tr[k])}" for k in m)
                       + f"; checkpoints published in the last round: {', '.join(tr['published'])}")
    lines += ["", *details]
    emit(lines, args.write)


if __name__ == "__main__":
    main()
