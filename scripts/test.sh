#!/usr/bin/env bash
# Install what the tests need (fuse3, a venv, torch, the project) and run the
# whole suite. Needs root: the tests mount real FUSE file systems.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# Two worker processes, a test file to each at a time (a module's shared
# mount is set up once): most tests wait on a daemon, a store or a
# framework, so two cores run the suite in about 13 minutes instead of 23.
# Two is what the suite is measured with; `-n 0` after it runs it in this
# process, one test at a time.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile "$@"
