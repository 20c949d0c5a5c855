"""Write-back through a hostile store: how long until every file is published.

The engine (real inode tree, real local store, in-process) publishes a
checkpoint-shaped workload through a store wrapper that fails a share of
calls, hangs some past their deadline, and tears writes (part of the data
written, then an error). Reported against the same workload on a healthy
store, in one run: the time ratio, and that every file is byte-identical,
verified, with no staging litter.

    .venv/bin/python bench/bench_faults.py [--files 200] [--size 1M] [--errors 0.3] [--hangs 0.01] [--out F]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trio
from ckptfs.fs.memory import MemoryPool
from ckptfs.fs.tree import ROOT, InodeTree
from ckptfs.writeback.backend import open_store
from ckptfs.writeback.calls import Deadlines
from ckptfs.writeback.engine import Engine, Retry
from ckptfs.writeback.verify import verify
from common import emit, machine

W = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


class Hostile:
    """Fails `errors` of the calls, hangs `hangs` of them for `hang_s`, and
    tears stage calls (writes part of the data, then fails)."""

    def __init__(self, inner, errors: float, hangs: float, hang_s: float, seed: int) -> None:
        self.inner, self.errors, self.hangs, self.hang_s = inner, errors, hangs, hang_s
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts = {"calls": 0, "errors": 0, "hangs": 0, "torn": 0}

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr) or name in ("live_daemons", "unit_dir"):
            return attr

        def call(*args, **kwargs):
            with self.lock:
                self.counts["calls"] += 1
                roll = self.rng.random()
            if roll < self.hangs:
                with self.lock:
                    self.counts["hangs"] += 1
                time.sleep(self.hang_s)
            elif roll < self.hangs + self.errors:
                if name == "stage" and args:
                    with self.lock:
                        self.counts["torn"] += 1
                    first = next(iter(args[0]), b"")
                    self.inner.stage([first[: len(first) // 2]], -1)  # part of the bytes, left behind as a torn upload
                else:
                    with self.lock:
                        self.counts["errors"] += 1
                raise ConnectionError(f"injected fault in {name}")
            return attr(*args, **kwargs)

        return call


def run(root: Path, files: int, size: int, errors: float, hangs: float, seed: int) -> tuple[float, dict, bool, list[str]]:
    backend = open_store(str(root))
    backend.prepare("bench", time.time())
    tree = InodeTree(MemoryPool(8 << 30))
    engine = Engine(backend, tree, retry=Retry(first_s=0.05, max_s=0.5), deadlines=Deadlines(call_s=1.0, min_rate=64 << 20))
    tree.journal = engine
    hostile = Hostile(backend, errors, hangs, hang_s=5.0, seed=seed)
    if errors or hangs:
        engine.backend = hostile
    payloads = {}

    async def main() -> float:
        async with trio.open_nursery() as n:
            await n.start(engine.run)
            t0 = time.perf_counter()
            per_step = 20
            for step in range(files // per_step):
                tmp = tree.mkdir(ROOT, f"{step}.tmp".encode(), 0o755, 0, 0)
                for i in range(per_step):
                    data = os.urandom(size)
                    h = tree.create(tmp.ino, f"shard{i}".encode(), 0o644, W, 0, 0)
                    tree.write(h.fh, 0, data)
                    tree.release(h.fh)
                    payloads[f"{step}/shard{i}"] = data
                    await trio.lowlevel.checkpoint()
                tree.rename(ROOT, f"{step}.tmp".encode(), ROOT, str(step).encode())
                d = tree.lookup(ROOT, str(step).encode())
                h = tree.create(d.ino, b"commit_success.txt", 0o644, W, 0, 0)
                tree.write(h.fh, 0, b"ok")
                tree.release(h.fh)
                payloads[f"{step}/commit_success.txt"] = b"ok"
            await engine.flush()
            elapsed = time.perf_counter() - t0
            n.cancel_scope.cancel()
        return elapsed

    elapsed = trio.run(main)
    got = {}
    for dirpath, dirnames, names in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".ckptfs"]
        for name in names:
            p = os.path.join(dirpath, name)
            got[os.path.relpath(p, root)] = Path(p).read_bytes()
    backend.retire()
    staging = root / ".ckptfs" / "staging"
    litter = [str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file()]
    return elapsed, hostile.counts, got == payloads and verify(backend).clean, litter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--size", default="1M")
    ap.add_argument("--errors", type=float, default=0.3)
    ap.add_argument("--hangs", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args()
    size = int(a.size[:-1]) << {"K": 10, "M": 20}[a.size[-1]] if a.size[-1] in "KM" else int(a.size)
    with tempfile.TemporaryDirectory(prefix="ckptfs-bench-faults-") as tmp:
        healthy, _, ok_h, litter_h = run(Path(tmp) / "healthy", a.files, size, 0.0, 0.0, a.seed)
        faulty, counts, ok_f, litter_f = run(Path(tmp) / "faulty", a.files, size, a.errors, a.hangs, a.seed)
    lines = [
        "## Write-back through a hostile store",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {machine()}. Command: `.venv/bin/python bench/bench_faults.py "
        f"--files {a.files} --size {a.size} --errors {a.errors} --hangs {a.hangs}`.",
        "",
        "| run | time until all published | files byte-identical and verified | staging litter after retire |",
        "|---|---|---|---|",
        f"| healthy store | {healthy:.2f} s | {'yes' if ok_h else 'NO'} | {len(litter_h)} |",
        f"| {a.errors:.0%} errors, {a.hangs:.0%} calls hung 5 s (deadline 1 s), torn uploads | {faulty:.2f} s "
        f"({faulty / healthy:.1f}x) | {'yes' if ok_f else 'NO'} | {len(litter_f)} |",
        "",
        f"Injected: {counts['calls']} store calls, {counts['errors']} errors, {counts['torn']} torn uploads, {counts['hangs']} hung calls.",
    ]
    emit(lines, a.out)


if __name__ == "__main__":
    main()
