"""The daemon: mount lifecycle, control socket, status and metrics (wiring, no FUSE logic)."""
