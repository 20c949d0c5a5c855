#!/usr/bin/env bash
# Install everything ckptfs needs on a fresh Debian machine: fuse3 and its
# headers (pyfuse3 builds against them), a virtual environment in .venv, the
# CPU build of torch, and the project with its test extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each tool checked on its own: a machine may have some and not others.
missing=()
command -v fusermount3 >/dev/null || missing+=(fuse3)
command -v pkg-config >/dev/null || missing+=(pkg-config)
pkg-config --exists fuse3 2>/dev/null || missing+=(libfuse3-dev)  # pyfuse3 builds against it
command -v gcc >/dev/null || missing+=(gcc)
command -v getfattr >/dev/null || missing+=(attr)  # tests read user.ckptfs.* xattrs
{ command -v setpriv >/dev/null && command -v unshare >/dev/null; } || missing+=(util-linux)  # tests act as another user
command -v redis-server >/dev/null || missing+=(redis-server)  # cluster tests: the metadata engine on loopback
command -v openssl >/dev/null || missing+=(openssl)  # cluster tests: a certificate for Redis over TLS
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip wheel setuptools
# torch first and pinned: the local CPU build is served for this exact version.
python -c 'import torch' 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[test]'
# The project's own bytecode, as pip compiles an installed package's: an
# editable install leaves it to the first import, and with
# PYTHONDONTWRITEBYTECODE set every `ckptfs` command and daemon would compile
# every module again (about 0.1 s each).
python -m compileall -q ckptfs fs writeback daemon tools cluster >/dev/null
