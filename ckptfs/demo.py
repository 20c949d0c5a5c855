"""The ckptfs demo: checkpoint into RAM, crash, resume from RAM.

    python -m ckptfs.demo [--workdir DIR]

Mounts ckptfs at DIR/mnt over a local-directory store DIR/store, trains a
small CPU model that saves a checkpoint every few steps into the mount, kills
the trainer mid-run (as a crash would), restarts it, and resumes from the
latest checkpoint, which loads straight from the daemon's RAM. Unmounting
waits for write-back; the demo then checks every file in the store against
its checksum.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = 60
SAVE_EVERY = 5
CRASH_AFTER_CHECKPOINT = 6


def say(msg: str) -> None:
    print(f"\033[1m==>\033[0m {msg}" if sys.stdout.isatty() else f"==> {msg}", flush=True)


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "ckptfs.tools.cli", *args], text=True, capture_output=True)
    out = (r.stdout + r.stderr).strip()
    if out:
        print("    " + out.replace("\n", "\n    "))
    if check and r.returncode != 0:
        raise SystemExit(f"ckptfs {args[0]} failed")
    return r


# -- the trainer (runs in its own process) ------------------------------------
def train(ckpt_dir: Path, steps: int) -> None:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    start = 0
    existing = sorted(ckpt_dir.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    if existing:
        t = time.perf_counter()
        state = torch.load(existing[-1], map_location="cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
        print(f"    trainer: resumed from {existing[-1].name} in {1000 * (time.perf_counter() - t):.0f} ms (from RAM)", flush=True)
    x = torch.randn(512, 256)
    for step in range(start + 1, steps + 1):
        loss = ((model(x) - x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % SAVE_EVERY == 0:
            t = time.perf_counter()
            tmp = ckpt_dir / f".step-{step}.pt.tmp"
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt_dir / f"step-{step}.pt")
            for old in sorted(ckpt_dir.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))[:-2]:
                old.unlink()  # keep the latest two
            print(f"    trainer: step {step:3d} loss {loss.item():.4f}, checkpoint saved in "
                  f"{1000 * (time.perf_counter() - t):.0f} ms", flush=True)
        time.sleep(0.05)


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
    say(f"mounting ckptfs at {mnt} (store: {store})")
    cli("mount", str(mnt), "--store", str(store), "--memory-limit", "1G")
    try:
        ckpt = mnt / "run1"
        ckpt.mkdir(exist_ok=True)
        say(f"training; a checkpoint every {SAVE_EVERY} steps into {ckpt}")
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
        say(f"checkpoints in the mount after the crash: {sorted(p.name for p in ckpt.iterdir())}")
        say("restarting the trainer: it resumes from the latest checkpoint")
        r = subprocess.run([sys.executable, "-m", "ckptfs.demo", "--train", str(ckpt)], text=True)
        if r.returncode != 0:
            raise SystemExit("the restarted trainer failed")
        st = os.statvfs(mnt)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        say(f"status: {used / (1 << 20):.1f} MiB of RAM used of {st.f_blocks * st.f_frsize / (1 << 20):.0f} MiB")
    finally:
        say("unmounting: waits until everything is published to the store")
        cli("umount", str(mnt), check=False)
    try:
        from ckptfs.writeback.backend import open_store
        from ckptfs.writeback.verify import verify

        files = sorted(str(p.relative_to(store)) for p in store.rglob("*") if p.is_file() and ".ckptfs" not in p.parts)
        say(f"the store now holds plain files: {files}")
        report = verify(open_store(str(store)))
        say(f"verified against the manifest: {len(report.ok)} ok, {len(report.corrupt)} corrupt, "
            f"{len(report.missing)} missing, {len(report.extra)} unrecorded")
        if not report.clean:
            raise SystemExit("the store does not verify")
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    say("done")


if __name__ == "__main__":
    main()
