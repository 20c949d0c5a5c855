"""The ckptfs demo: continuous checkpointing into RAM, crash, resume from RAM.

    python -m ckptfs.demo [--workdir DIR] [--keep]

Mounts ckptfs at DIR/mnt over a local-directory store DIR/store and trains a
small CPU model with `ckptfs.torch.CheckpointManager`: continuous
checkpointing (a new checkpoint as soon as the previous one is published),
keeping the latest two. It kills the trainer mid-run (as a crash would),
restarts it, and resumes from the latest published checkpoint, which loads
straight from the daemon's RAM. Then `ckptfs status`, `ckptfs flush`,
`ckptfs verify` against the store's checksums, and `ckptfs umount`.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = 60
MIN_INTERVAL_S = 0.4  # continuous checkpointing, at most this often
CRASH_AFTER_CHECKPOINT = 4


def say(msg: str) -> None:
    print(f"\033[1m==>\033[0m {msg}" if sys.stdout.isatty() else f"==> {msg}", flush=True)


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    say("ckptfs " + " ".join(args))
    r = subprocess.run([sys.executable, "-m", "ckptfs.tools.cli", *args], text=True, capture_output=True)
    out = (r.stdout + r.stderr).rstrip()
    if out:
        print("    " + out.replace("\n", "\n    "), flush=True)
    if check and r.returncode != 0:
        raise SystemExit(f"ckptfs {args[0]} failed")
    return r


# -- the trainer (runs in its own process) ------------------------------------
def train(ckpt_dir: Path, steps: int) -> None:
    import torch

    import ckptfs.torch as ct

    mgr = ct.CheckpointManager(ckpt_dir, ct.save_policy.ContinuousCheckpointing(minimum_interval_secs=MIN_INTERVAL_S),
                               ct.preservation.LatestN(2))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    start = 0
    if (latest := mgr.latest_step()) is not None:
        t = time.perf_counter()
        state = mgr.restore()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
        print(f"    trainer: resumed from step {latest} in {1000 * (time.perf_counter() - t):.0f} ms (from RAM)", flush=True)
    x = torch.randn(512, 256)
    for step in range(start + 1, steps + 1):
        loss = ((model(x) - x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = time.perf_counter()
        if mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, force=step == steps):
            print(f"    trainer: step {step:3d} loss {loss.item():.4f}, checkpoint saved in "
                  f"{1000 * (time.perf_counter() - t):.0f} ms", flush=True)
        time.sleep(0.05)
    mgr.wait_until_published(timeout=120)
    print(f"    trainer: done; checkpoints {mgr.all_steps()}, latest published {mgr.latest_step()}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="where to put the mount and the store (default: a new temp dir)")
    ap.add_argument("--train", metavar="CKPT_DIR", help=argparse.SUPPRESS)
    ap.add_argument("--keep", action="store_true", help="keep the work dir afterwards")
    args = ap.parse_args()
    if args.train:
        train(Path(args.train), STEPS)
        return

    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckptfs-demo-"))
    mnt, store = work / "mnt", work / "store"
    mnt.mkdir(parents=True, exist_ok=True)
    cli("mount", str(mnt), "--store", str(store), "--memory-limit", "1G")
    try:
        ckpt = mnt / "run1"
        say(f"training with continuous checkpointing into {ckpt} (keeping the latest 2)")
        trainer = subprocess.Popen([sys.executable, "-m", "ckptfs.demo", "--train", str(ckpt)], stdout=subprocess.PIPE, text=True)
        saved = 0
        assert trainer.stdout is not None
        for line in trainer.stdout:
            print(line, end="", flush=True)
            saved += "checkpoint saved" in line
            if saved == CRASH_AFTER_CHECKPOINT:
                break
        say("simulating a crash: SIGKILL to the trainer")
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        say(f"the mount after the crash: {sorted(p.name for p in ckpt.iterdir())}")
        say("restarting the trainer: it resumes from the latest published checkpoint")
        r = subprocess.run([sys.executable, "-m", "ckptfs.demo", "--train", str(ckpt)], text=True)
        if r.returncode != 0:
            raise SystemExit("the restarted trainer failed")
        cli("status", str(mnt), "--files")
        cli("flush", str(mnt))
        cli("verify", str(mnt))
    finally:
        cli("umount", str(mnt), check=False)
    if not args.keep and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    say("done")


if __name__ == "__main__":
    main()
