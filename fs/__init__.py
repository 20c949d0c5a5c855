"""The FUSE layer: a FUSE-free inode store and a thin pyfuse3 adapter over it."""
