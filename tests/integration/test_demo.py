"""The README's main command does what it says."""

import subprocess
import sys

from tests.mountutil import is_mounted


def test_demo_resumes_from_ram_after_a_crash(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ckptfs.demo", "--workdir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SIGKILL to the trainer" in r.stdout
    assert "resumed from step-30.pt" in r.stdout
    assert "step  60" in r.stdout
    assert not is_mounted(tmp_path / "mnt")
    assert "run1/step-60.pt" in r.stdout and "2 ok, 0 corrupt, 0 missing, 0 unrecorded" in r.stdout
