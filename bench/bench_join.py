"""A node joining a running cluster: replaying the whole log vs loading the
namespace's snapshot and replaying what follows it (issue 13).

One replica (in-process, a real Redis on loopback started and stopped here)
makes a namespace of N files: the store's restore entry, as the first node
of a cluster appends it, then C namespace changes and seals' worth of
entries made one by one. Then, interleaved per round:

- a late replica replays the whole log (no snapshot);
- the first replica takes a snapshot (`take` + `encode`, on its event loop:
  what the publishing node pauses for), saves it and trims the log;
- a late replica loads the snapshot and replays the rest.

    .venv/bin/python bench/bench_join.py --files 100000 --changes 20000 --write bench/RESULTS-join.md
"""

from __future__ import annotations

import argparse
import gc
import stat
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ckptfs.cluster import snapshot
from ckptfs.cluster.log import SharedLog, Where
from ckptfs.cluster.namespace import SharedNamespace
from ckptfs.fs.memory import MemoryPool
from ckptfs.fs.tree import ROOT, InodeTree
from common import emit, machine, median

from tests.redisserver import RedisServer

STORE = "file:///nonexistent/bench-join-store"
PER_DIR = 1000


def replica(redis: RedisServer, name: str) -> SharedNamespace:
    shared = SharedLog(Where(redis.url, str(redis.password_file)))
    shared.open(STORE)
    return SharedNamespace(InodeTree(MemoryPool(1 << 30)), shared, name)


async def build(first: SharedNamespace, files: int, changes: int) -> None:
    entries = []
    for i in range(files):
        path = f"d{i // PER_DIR:04d}/f{i:07d}"
        entries.append([path, stat.S_IFREG | 0o644, 100, 1_700_000_000_000_000_000 + i, "", 0, 0])
        first.tree.restore(*entries[-1])
    await first.restored(entries)
    d = await first.change("mkdir", ROOT, b"new", 0o755, 0, 0)
    for i in range(changes):  # a checkpoint's worth of names, made one by one
        await first.change("mknod", d.ino, f"g{i:07d}".encode(), stat.S_IFREG | 0o644, 0, 0)


async def one_round(redis: RedisServer, first: SharedNamespace) -> dict[str, float]:
    out: dict[str, float] = {}
    late = replica(redis, "late-replay")
    gc.disable()  # as the daemon replays the log (daemon.mount); loading the snapshot does the same
    t = time.perf_counter()
    await late.catch_up()
    out["replay"] = time.perf_counter() - t
    gc.enable()
    assert late.position == first.position
    late.log.close()

    t = time.perf_counter()
    position, state = await first.take_snapshot()
    out["take"] = time.perf_counter() - t
    t = time.perf_counter()
    blob = snapshot.encode(position, state)
    out["encode"] = time.perf_counter() - t
    out["bytes"] = len(blob)
    first.log.redis.delete(first.log.snapshot_key)  # each round saves anew
    pipe = first.log.redis.pipeline(transaction=True)
    first.log.save_snapshot(pipe, position, blob, snapshot.TRIM_GRACE_S)
    pipe.execute()

    late = replica(redis, "late-snapshot")
    t = time.perf_counter()
    assert await trio.to_thread.run_sync(late.load_snapshot) is not None
    await late.catch_up()
    out["load"] = time.perf_counter() - t
    assert late.position == first.position and len(late.tree.inodes) == len(first.tree.inodes)
    late.log.close()
    return out


async def run(args: argparse.Namespace, redis: RedisServer) -> list[dict[str, float]]:
    first = replica(redis, "first")
    t = time.perf_counter()
    await build(first, args.files, args.changes)
    print(f"built {first.position} log entries ({args.files} files restored, {args.changes} changes) in {time.perf_counter() - t:.1f}s")
    rounds = []
    for r in range(args.rounds):
        # Each round replays the whole log: put back the entries the previous round trimmed
        if r:
            redis.flush()
            first = replica(redis, "first")
            await build(first, args.files, args.changes)
        rounds.append(await one_round(redis, first))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in rounds[-1].items()))
    return rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--changes", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckptfs-bench-join-") as tmp:
        redis = RedisServer(Path(tmp) / "redis")
        redis.start()
        try:
            rounds = trio.run(run, args, redis)
        finally:
            redis.stop()
    m = {k: median([r[k] for r in rounds]) for k in rounds[0]}
    entries = args.changes + 2
    lines = [
        "## A node joining a running cluster: the log vs the snapshot",
        "",
        f"{machine()}; one Redis on loopback; a namespace of {args.files:,} files restored from the store plus "
        f"{args.changes:,} files made one by one ({entries:,} log entries); {args.rounds} rounds, medians.",
        f"Command: `.venv/bin/python bench/bench_join.py --files {args.files} --changes {args.changes} --rounds {args.rounds}`",
        "",
        "| what | seconds |",
        "|---|---|",
        f"| a late node replays the whole log | {m['replay']:.2f} |",
        f"| a late node loads the snapshot and replays the rest | {m['load']:.2f} |",
        f"| the publishing node takes the snapshot (in slices of its event loop; reads and writes go on) | {m['take']:.2f} |",
        f"| ... and compresses it (in a thread) | {m['encode']:.2f} |",
        "",
        f"The snapshot is {m['bytes'] / 2**20:.1f} MiB in Redis; the log before it is trimmed away.",
        "",
        "- per round: " + "; ".join(", ".join(f"{k} {v:.2f}" for k, v in r.items() if k != "bytes") for r in rounds),
    ]
    emit(lines, args.write)


if __name__ == "__main__":
    main()
