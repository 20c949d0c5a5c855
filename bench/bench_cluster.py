"""Cluster mode: 1, 2 and 3 daemons of one cluster (one Redis, one local
store) saving at once, one writer per node. Per node: publication
throughput (its bytes / time from its first write until its last file is in
the store), as a ratio to one node alone; and the time from the last
writer's close to a marker written after it being in the store. Run as root:

    .venv/bin/python bench/bench_cluster.py --rounds 2 --write bench/RESULTS-cluster.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import emit, machine, median, mounted

from tests.redisserver import RedisServer

MIB = 1 << 20


def wait_in_store(paths: list[Path], size: int, timeout: float = 600) -> float:
    deadline = time.monotonic() + timeout
    while not all(p.exists() and p.stat().st_size == size for p in paths):
        if time.monotonic() > deadline:
            raise SystemExit(f"not published: {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.002)
    return time.perf_counter()


def one_round(n: int, files: int, size: int, redis: RedisServer | None, base: Path, tag: str) -> tuple[list[float], float]:
    """(per-node MB/s, seconds from the last close to the marker in the
    store). `redis` None: the reference, n independent daemons (no
    cluster), each with a store of its own on the same disk."""
    buf = os.urandom(size)
    with ExitStack() as stack:
        mps, stores = [], []
        for i in range(n):
            store = base / "store" if redis is not None else base / f"node{i}" / "store"
            extra = ("--store", str(store))
            if redis is not None:
                extra += ("--cluster", redis.url, "--cluster-password-file", str(redis.password_file), "--node", f"n{i}")
            mp, _pid = stack.enter_context(mounted(base / f"node{i}", memory_limit="3G", extra=extra))
            mps.append(mp)
            stores.append(store)
        for i in range(n):
            (mps[0 if redis is not None else i] / tag).mkdir(exist_ok=True)
            (mps[0 if redis is not None else i] / tag / f"n{i}").mkdir()
        rates: list[float] = [0.0] * n
        closed: list[float] = [0.0] * n
        barrier = threading.Barrier(n + 1)

        def writer(i: int) -> None:
            targets = [stores[i] / tag / f"n{i}" / f"f{j}" for j in range(files)]
            t0 = time.perf_counter()
            for j in range(files):
                with open(mps[i] / tag / f"n{i}" / f"f{j}", "wb") as f:
                    f.write(buf)
            closed[i] = time.perf_counter()
            barrier.wait()
            done = wait_in_store(targets, size)
            rates[i] = files * size / (done - t0) / 1e6

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        barrier.wait()  # every writer closed its files: node 0 writes the marker (DCP's .metadata after its barrier)
        with open(mps[0] / tag / ".metadata", "wb") as f:
            f.write(b"plan")
        shown = wait_in_store([stores[0] / tag / ".metadata"], 4)
        for t in threads:
            t.join()
        return rates, shown - max(closed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--size-mib", type=int, default=128)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--write", metavar="FILE")
    args = ap.parse_args()
    size = args.size_mib * MIB
    base = Path(tempfile.mkdtemp(prefix="cluster-", dir=args.dir))
    redis = RedisServer(base / "redis")
    redis.start()
    results: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
    try:
        for r in range(args.rounds):
            for n in (1, 2, 3):
                for kind in ("cluster", "independent"):  # side by side, interleaved
                    redis.flush()
                    round_dir = base / f"r{r}-n{n}-{kind}"
                    rates, marker = one_round(n, args.files, size, redis if kind == "cluster" else None, round_dir, f"step-{r}")
                    shutil.rmtree(round_dir, ignore_errors=True)
                    per, marks = results.setdefault((kind, n), ([], []))
                    per.extend(rates)
                    marks.append(marker)
                    print(f"round {r + 1}, {n} {kind} daemon(s): per node {', '.join(f'{x:.0f}' for x in rates)} MB/s; "
                          f"marker in the store {marker * 1000:.0f} ms after the last close", flush=True)
    finally:
        redis.stop()
        shutil.rmtree(base, ignore_errors=True)
    alone = median(results[("cluster", 1)][0])
    lines = ["# Cluster mode: nodes saving at once", "",
             f"Machine: {machine()}. Every daemon runs on this machine (one per node), one writer thread per node writing "
             f"{args.files} files of {args.size_mib} MiB, then node 0 writes `.metadata` (DCP's pattern). Cluster: one "
             f"Redis on loopback, one local-directory store in {args.dir}. Reference, run interleaved with it: as many "
             "independent daemons (no cluster), each with a store of its own on the same disk, so that what the nodes "
             f"share here (2 cores, one disk) weighs on both alike. Median of {args.rounds} rounds.", "",
             "| daemons | cluster: per-node MB/s | vs one cluster node | independent daemons: per-node MB/s | cluster vs independent "
             "| cluster: marker in the store after the last data close | independent: the same |",
             "|---|---|---|---|---|---|---|"]
    for n in (1, 2, 3):
        per, marks = results[("cluster", n)]
        ref, ref_marks = results[("independent", n)]
        lines.append(f"| {n} | {median(per):.0f} | {median(per) / alone:.2f}x | {median(ref):.0f} | {median(per) / median(ref):.2f}x "
                     f"| {median(marks) * 1000:.0f} ms | {median(ref_marks) * 1000:.0f} ms |")
    lines += ["", "Goal (issue 13): per-node throughput >= 0.8x of one node. On one machine the nodes share its cores and "
              "disk, so the column that isolates what cluster mode costs is \"cluster vs independent\"; \"vs one cluster "
              "node\" also carries the sharing of this machine."]
    emit(lines, args.write)


if __name__ == "__main__":
    main()
