"""Cluster mode: 1, 2 and 3 daemons of one cluster (one Redis, one store)
saving at once, one writer per node. Per node: publication throughput (its
bytes / time from its first write until its last file is in the store), as
a ratio to one node alone; and the time from the last writer's close to a
marker written after it being in the store. The store is a local directory,
or with `--s3` a bucket of SeaweedFS on loopback (started and stopped here).
Run as root:

    .venv/bin/python bench/bench_cluster.py --rounds 2 --write bench/RESULTS-cluster.md
    .venv/bin/python bench/bench_cluster.py --s3 --rounds 2 --write bench/RESULTS-cluster-s3.md
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
from tests.s3server import S3Server, start_s3

MIB = 1 << 20


class Store:
    """Where a round's daemons publish: a local directory, or an S3 bucket."""

    def __init__(self, base: Path, s3: S3Server | None, name: str) -> None:
        self.s3, self.path = s3, base / name
        self.url = s3.bucket(f"{base.name}-{name}") if s3 is not None else str(self.path)  # a bucket per round
        self.fs = s3._s3fs() if s3 is not None else None

    def options(self) -> tuple[str, ...]:
        return ("--store", self.url, *(self.s3.cli_options() if self.s3 is not None else ()))

    def size(self, key: str) -> int:
        """The size of the published file `key`; -1 while there is none."""
        if self.fs is None:
            p = self.path / key
            return p.stat().st_size if p.exists() else -1
        try:
            return self.fs.info(f"{self.url.removeprefix('s3://')}/{key}", refresh=True)["size"]
        except FileNotFoundError:
            return -1


def wait_in_store(store: Store, keys: list[str], size: int, timeout: float = 600) -> float:
    deadline = time.monotonic() + timeout
    pause = 0.002 if store.fs is None else 0.02
    while not all(store.size(k) == size for k in keys):
        if time.monotonic() > deadline:
            raise SystemExit(f"not published: {[k for k in keys if store.size(k) != size]}")
        time.sleep(pause)
    return time.perf_counter()


def one_round(n: int, files: int, size: int, redis: RedisServer | None, base: Path, tag: str,
              s3: S3Server | None) -> tuple[list[float], float]:
    """(per-node MB/s, seconds from the last close to the marker in the
    store). `redis` None: the reference, n independent daemons (no
    cluster), each with a store of its own on the same disk (or server)."""
    buf = os.urandom(size)
    with ExitStack() as stack:
        mps, stores = [], []
        for i in range(n):
            store = Store(base, s3, "store" if redis is not None else f"node{i}-store")
            extra = store.options()
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
            targets = [f"{tag}/n{i}/f{j}" for j in range(files)]
            t0 = time.perf_counter()
            for j in range(files):
                with open(mps[i] / tag / f"n{i}" / f"f{j}", "wb") as f:
                    f.write(buf)
            closed[i] = time.perf_counter()
            barrier.wait()
            done = wait_in_store(stores[i], targets, size)
            rates[i] = files * size / (done - t0) / 1e6

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        barrier.wait()  # every writer closed its files: node 0 writes the marker (DCP's .metadata after its barrier)
        with open(mps[0] / tag / ".metadata", "wb") as f:
            f.write(b"plan")
        shown = wait_in_store(stores[0], [f"{tag}/.metadata"], 4)
        for t in threads:
            t.join()
        return rates, shown - max(closed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--size-mib", type=int, default=128)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--s3", action="store_true", help="publish to SeaweedFS on loopback instead of a local directory")
    ap.add_argument("--write", metavar="FILE")
    args = ap.parse_args()
    size = args.size_mib * MIB
    base = Path(tempfile.mkdtemp(prefix="cluster-", dir=args.dir))
    s3 = start_s3(base / "s3") if args.s3 else None
    redis = RedisServer(base / "redis")
    redis.start()
    results: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
    try:
        for r in range(args.rounds):
            for n in (1, 2, 3):
                for kind in ("cluster", "independent"):  # side by side, interleaved
                    redis.flush()
                    round_dir = base / f"r{r}-n{n}-{kind}"
                    rates, marker = one_round(n, args.files, size, redis if kind == "cluster" else None, round_dir, f"step-{r}", s3)
                    shutil.rmtree(round_dir, ignore_errors=True)
                    per, marks = results.setdefault((kind, n), ([], []))
                    per.extend(rates)
                    marks.append(marker)
                    print(f"round {r + 1}, {n} {kind} daemon(s): per node {', '.join(f'{x:.0f}' for x in rates)} MB/s; "
                          f"marker in the store {marker * 1000:.0f} ms after the last close", flush=True)
    finally:
        redis.stop()
        if s3 is not None:
            s3.stop()
        shutil.rmtree(base, ignore_errors=True)
    alone = median(results[("cluster", 1)][0])
    where = "a bucket of SeaweedFS (`weed server -s3`) on loopback, its data in " + args.dir if args.s3 else f"a local directory in {args.dir}"
    lines = ["# Cluster mode: nodes saving at once", "",
             f"Machine: {machine()}. Every daemon runs on this machine (one per node), one writer thread per node writing "
             f"{args.files} files of {args.size_mib} MiB, then node 0 writes `.metadata` (DCP's pattern). Cluster: one "
             f"Redis on loopback, one store: {where}. Reference, run interleaved with it: as many "
             "independent daemons (no cluster), each with a store of its own on the same disk, so that what the nodes "
             f"share here (2 cores, one disk) weighs on both alike. Median of {args.rounds} rounds.",
             f"Command: `.venv/bin/python bench/bench_cluster.py{' --s3' if args.s3 else ''} --rounds {args.rounds} "
             f"--files {args.files} --size-mib {args.size_mib}`", "",
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
