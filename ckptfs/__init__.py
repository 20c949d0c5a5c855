"""ckptfs: a RAM-backed FUSE file system for training checkpoints, persisted
in the background to any fsspec store.

`ckptfs.Client(path)` talks to the daemon of the mount holding `path`;
`ckptfs.torch` (imported on its own: it needs torch) has the training helpers.
"""

__version__ = "0.1.0"

from ckptfs.client import Client

__all__ = ["Client", "__version__"]
