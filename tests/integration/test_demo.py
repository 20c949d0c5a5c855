"""The README's main command does what it says."""

import re
import subprocess
import sys

from tests.mountutil import is_mounted


def test_demo_resumes_from_ram_after_a_crash(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ckptfs.demo", "--workdir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    before, after = out.split("SIGKILL to the trainer")
    saved_before = [int(s) for s in re.findall(r"step +(\d+) loss .* checkpoint saved", before)]
    assert len(saved_before) == 4
    resumed = int(re.search(r"resumed from step (\d+) in \d+ ms \(from RAM\)", after).group(1))
    assert resumed in saved_before[-2:]  # the latest published one (the last, unless it was still in flight)
    assert "step  60" in after and "checkpoints [" in after
    assert re.search(r"run1/step-60/state.pt +│ +6.0 MiB │ published", after)  # ckptfs status --files
    assert "4 ok, 0 corrupt, 0 missing, 0 extra" in after  # ckptfs verify
    assert "everything is published" in after
    assert not is_mounted(tmp_path / "mnt")
