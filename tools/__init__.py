"""The `ckptfs` command line."""
