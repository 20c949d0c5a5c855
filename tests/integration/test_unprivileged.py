"""A daemon run by a user who is not root, as most users run it: every
other test runs the daemon as root, whom permission bits do not stop.

The run is in a private mount and PID namespace (`unshare`): a `/dev/fuse`
that user may open is bound over the machine's (which only root may open
here), the interpreter, its venv and the checkout are reached through a tmpfs
over `/root` (which that user may not search), and when the run ends, or the
test gives up on it, the kernel kills every process in it, the daemon too,
and its mount goes with its namespace."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

NOBODY = 65534
RUN_TIMEOUT_S = 300
REPO = Path(__file__).resolve().parents[2]

# Run as nobody: a training job's save, a restart, and what the admin tools say.
SCRIPT = r'''
import glob, json, os, stat, subprocess, sys
import torch

mp, store, spill, out = sys.argv[1:5]
facts = {}

def cli(*args):
    r = subprocess.run([sys.executable, "-m", "ckptfs.tools.cli", *args], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:  # the rest would run on a plain directory
        sys.exit(f"ckptfs {args[0]} failed ({r.returncode}): {r.stdout}{r.stderr}")
    return r.stdout + r.stderr

cli("mount", mp, "--store", store, "--memory-limit", "16M", "--spill-dir", spill)
state = {"w": torch.arange(1000.0)}
os.makedirs(f"{mp}/ck")
torch.save(state, f"{mp}/ck/model.pt")
big = os.urandom(24 << 20)  # more than the RAM budget: continues in the spill directory
with open(f"{mp}/ck/big.bin", "wb") as f:
    f.write(big)
with open(f"{mp}/wo", "wb") as f:
    f.write(b"first")
os.chmod(f"{mp}/wo", 0o200)
with open(f"{mp}/secret", "wb") as f:
    f.write(b"key")
os.chmod(f"{mp}/secret", 0o600)
cli("flush", mp)
logs = glob.glob(os.environ["CKPTFS_RUNTIME_DIR"] + "/*/daemon.log")
facts["spilled"] = any(f"on disk in {spill}" in open(p).read() for p in logs)
cli("status", mp)
cli("umount", mp)

cli("mount", mp, "--store", store, "--memory-limit", "16M", "--spill-dir", spill)
facts["loaded"] = bool(torch.equal(torch.load(f"{mp}/ck/model.pt")["w"], state["w"]))
with open(f"{mp}/ck/big.bin", "rb") as f:
    facts["big"] = f.read() == big
cli("evict", f"{mp}/ck")
cli("prefetch", f"{mp}/ck/model.pt")
facts["loaded again"] = bool(torch.equal(torch.load(f"{mp}/ck/model.pt")["w"], state["w"]))
try:
    fd = os.open(f"{mp}/wo", os.O_WRONLY | os.O_APPEND)  # the daemon loads it from the store first
    os.write(fd, b"+more")
    os.close(fd)
    facts["append"] = "ok"
except OSError as exc:
    facts["append"] = str(exc)
facts["modes"] = {n: [stat.S_IMODE(st.st_mode), st.st_uid] for n in ("wo", "secret", "ck") for st in [os.stat(f"{mp}/{n}")]}
cli("flush", mp)
cli("umount", mp)
facts["verify"] = cli("verify", store)
facts["store"] = {n: [stat.S_IMODE(st.st_mode), st.st_uid] for n in ("wo", "secret") for st in [os.stat(f"{store}/{n}")]}
try:
    with open(f"{store}/wo", "rb") as f:
        facts["wo"] = f.read().decode()
except OSError as exc:
    facts["wo"] = str(exc)
with open(out, "w") as f:
    json.dump(facts, f)
'''


def _under_root(path: Path) -> str | None:
    """`path` relative to /root, if it lies below it."""
    try:
        return str(path.resolve().relative_to("/root"))
    except ValueError:
        return None


def _namespace_script(root: Path, argv: list[str]) -> str:
    """Run as root inside the new namespaces, then become nobody."""
    lines = ["set -e", "mount --make-rprivate /"]
    below: list[str] = []
    for rel in sorted(filter(None, map(_under_root, (Path(sys.base_prefix), Path(sys.prefix), REPO)))):  # the interpreter, the venv, the checkout
        if not any(rel == b or rel.startswith(b + "/") for b in below):  # (one inside another comes with it)
            below.append(rel)
    if below:
        lines += [f"mkdir {root}/orig", f"mount --bind /root {root}/orig", "mount -t tmpfs -o mode=0755 tmpfs /root"]
        for rel in below:
            lines += [f"mkdir -p /root/{rel}", f"mount --bind {root}/orig/{rel} /root/{rel}"]
    lines += [f"mknod {root}/fuse c 10 229", f"chmod 0666 {root}/fuse", f"mount --bind {root}/fuse /dev/fuse",
              f"exec setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups env HOME={root}/home "
              f"CKPTFS_RUNTIME_DIR={root}/run " + " ".join(argv)]
    return "\n".join(lines)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("setpriv") is None,
                    reason="needs root, unshare and setpriv")
def test_a_daemon_run_by_a_user_who_is_not_root_saves_restarts_and_verifies():
    """nobody mounts over a store it owns, saves a checkpoint (one file of
    it larger than the RAM budget: spilled), a write-only file and a private
    one, flushes and unmounts; a remount loads the checkpoint, evicts and
    prefetches it, appends to the write-only file (the daemon must read its
    own store file to load it), and `verify` passes. Modes and owners come back;
    the store keeps its files readable by their owner, never by others."""
    root = Path(tempfile.mkdtemp(prefix="ckptfs-nobody-"))  # nobody must reach it: not under the test's 0700 tmp_path
    try:
        os.chmod(root, 0o755)
        for d in ("mnt", "store", "spill", "run", "home"):
            (root / d).mkdir()
            os.chown(root / d, NOBODY, NOBODY)
        os.chmod(root / "run", 0o700)
        (root / "script.py").write_text(SCRIPT)
        argv = [sys.executable, str(root / "script.py"), str(root / "mnt"), str(root / "store"), str(root / "spill"),
                str(root / "home" / "facts.json")]
        r = subprocess.run(["unshare", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "bash", "-c",
                            _namespace_script(root, argv)], capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd="/")
        assert r.returncode == 0, r.stdout + r.stderr
        facts = json.loads((root / "home" / "facts.json").read_text())
        assert "4 ok, 0 corrupt, 0 missing, 0 extra" in facts["verify"], facts["verify"]
        assert facts["spilled"] is facts["loaded"] is facts["big"] is facts["loaded again"] is True
        assert facts["append"] == "ok"
        assert facts["modes"] == {"wo": [0o200, NOBODY], "secret": [0o600, NOBODY], "ck": [0o755, NOBODY]}
        assert facts["store"] == {"wo": [0o600, NOBODY], "secret": [0o600, NOBODY]}
        assert facts["wo"] == "first+more"
    finally:
        shutil.rmtree(root, ignore_errors=True)
