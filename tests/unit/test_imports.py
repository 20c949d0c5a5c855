"""`import ckptfs` (and everything but ckptfs.torch) never imports torch."""

import subprocess
import sys


def test_ckptfs_does_not_import_torch():
    code = ("import sys, ckptfs, ckptfs.client, ckptfs.checkpoint, ckptfs.policies, ckptfs.gasp, ckptfs.fallback, ckptfs.advise, "
            "ckptfs.tools.cli; assert 'torch' not in sys.modules, 'torch imported'; "
            "import ckptfs.torch; assert 'torch' in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
