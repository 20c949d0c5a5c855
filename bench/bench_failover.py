"""Cluster mode: how long publishing pauses when the publishing node goes.

Two daemons of one cluster (one Redis, one local store). Node n1 writes a
shard and a `.metadata` marker after it, first with the publishing node n0
alive (the reference: the marker's usual latency from its close to the
store), then right after n0 is killed (kill -9: its daemon is gone from this
host, which n1 sees at its next heartbeat) or frozen (SIGSTOP: what a node on
another host looks like when it dies; n1 waits for its key in Redis to lapse).
The figure is the time from n0's end to n1's marker being in the store.
Run as root:

    .venv/bin/python bench/bench_failover.py --rounds 3 --write bench/RESULTS-failover.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import emit, machine, median, mounted

from tests.redisserver import RedisServer

SHARD = os.urandom(1 << 20)


def save(mp: Path, store: Path, step: str) -> float:
    """Write a shard then its marker on `mp`; when the marker is in `store` (perf_counter)."""
    (mp / step).mkdir()
    (mp / step / "shard").write_bytes(SHARD)
    (mp / step / ".metadata").write_bytes(b"plan")
    marker = store / step / ".metadata"
    deadline = time.monotonic() + 120
    while not marker.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{step}/.metadata not published within 120 s")
        time.sleep(0.002)
    return time.perf_counter()


def one_round(redis: RedisServer, base: Path, how: str) -> tuple[float, float]:
    """(the marker's latency with the publishing node alive, the time from
    its end to the next marker in the store), in seconds."""
    store = base / "store"
    with ExitStack() as stack:
        nodes = []
        for i in range(2):
            extra = ("--store", str(store), "--cluster", redis.url, "--cluster-password-file", str(redis.password_file), "--node", f"n{i}")
            nodes.append(stack.enter_context(mounted(base / f"n{i}", memory_limit="2G", extra=extra)))
        (_, pid0), (mp1, _) = nodes
        t = time.perf_counter()
        alive = save(mp1, store, "alive") - t
        os.kill(pid0, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t = time.perf_counter()
        try:
            gone = save(mp1, store, "after") - t
        finally:
            if how == "freeze":
                os.kill(pid0, signal.SIGCONT)  # it wakes, finds its key taken, and follows
    return alive, gone


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--write", metavar="FILE")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="failover-", dir=args.dir))
    redis = RedisServer(base / "redis")
    redis.start()
    results: dict[str, tuple[list[float], list[float]]] = {"kill": ([], []), "freeze": ([], [])}
    try:
        for r in range(args.rounds):
            for how in ("kill", "freeze"):
                redis.flush()
                round_dir = base / f"r{r}-{how}"
                alive, gone = one_round(redis, round_dir, how)
                shutil.rmtree(round_dir, ignore_errors=True)
                results[how][0].append(alive)
                results[how][1].append(gone)
                print(f"round {r + 1}, {how}: marker {alive * 1000:.0f} ms after its close with the publishing node alive; "
                      f"{gone:.2f} s after the publishing node's end", flush=True)
    finally:
        redis.stop()
        shutil.rmtree(base, ignore_errors=True)
    lines = ["# Cluster mode: publishing node failover", "",
             f"Machine: {machine()}. Two daemons of one cluster on this machine, one Redis on loopback, one local-directory "
             f"store in {args.dir}. Node n1 writes a 1 MiB shard and a `.metadata` marker; the figure is the time until "
             f"the marker is in the store. Median of {args.rounds} rounds.", "",
             "| how the publishing node goes | marker in the store, publishing node alive (from its close) "
             "| marker in the store, after the publishing node's end (from the end) |",
             "|---|---|---|"]
    for how, what in (("kill", "kill -9 (its daemon gone from this host)"), ("freeze", "SIGSTOP (as a node on another host: its key lapses)")):
        alive, gone = results[how]
        lines.append(f"| {what} | {median(alive) * 1000:.0f} ms | {median(gone):.2f} s |")
    lines += ["", "A node on this host sees a dead daemon at its next heartbeat (1 s) and takes over at once. A node that "
              "only stops answering is replaced once its key in Redis lapses, 10 s after its last heartbeat, so the pause "
              "is bounded by about 11 s plus the rebuild (a scan of the store)."]
    emit(lines, args.write)


if __name__ == "__main__":
    main()
