"""`import ckptfs` (and everything but ckptfs.torch) never imports torch."""

import subprocess
import sys


def test_ckptfs_does_not_import_torch():
    code = ("import sys, ckptfs, ckptfs.client, ckptfs.checkpoint, ckptfs.policies, ckptfs.gasp, ckptfs.fallback, ckptfs.advise, "
            "ckptfs.tools.cli; assert 'torch' not in sys.modules, 'torch imported'; "
            "import ckptfs.torch; assert 'torch' in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_a_daemon_over_a_local_store_does_not_import_fsspec(tmp_path):
    """fsspec (and asyncio under it) costs every `ckptfs mount` about 0.08 s
    to import, and a local store never needs it: a restart's start."""
    code = (f"import sys, ckptfs.tools.cli, ckptfs.daemon.mount; from ckptfs.writeback.backend import open_store; "
            f"b = open_store({str(tmp_path / 'store')!r}); assert type(b).__name__ == 'LocalBackend'; "
            f"assert 'fsspec' not in sys.modules, 'fsspec imported'; "
            f"open_store('memory://x'); assert 'fsspec' in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
