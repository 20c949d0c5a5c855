#!/usr/bin/env bash
# The main job: mount ckptfs over a local-directory store, train a small model
# that checkpoints into it, crash the trainer, resume from RAM, unmount.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m ckptfs.demo "$@"
