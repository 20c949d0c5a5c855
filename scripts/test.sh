#!/usr/bin/env bash
# Install what the tests need (fuse3, a venv, torch, the project) and run the
# whole suite. Needs root: the tests mount real FUSE file systems.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
