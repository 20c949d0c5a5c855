"""ckptfs: a RAM-backed FUSE file system for training checkpoints, persisted
in the background to any fsspec store."""

__version__ = "0.1.0"
