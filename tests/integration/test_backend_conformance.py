"""One conformance suite for the store adapter, run on every kind of store
(in the style of fsspec's tests/abstract): memory://, file://, and s3:// on a
real S3 server on loopback."""

from __future__ import annotations

import itertools
import os

import pytest
from ckptfs.writeback import backend as backend_mod
from ckptfs.writeback import manifest
from ckptfs.writeback.backend import open_store

_n = itertools.count()


@pytest.fixture(params=["memory", "file", "s3"])
def store(request, tmp_path):
    kind = request.param
    if kind == "memory":
        import fsspec

        fsspec.filesystem("memory").store.clear()  # global state: start clean
        yield open_store(f"memory://ckptfs-{next(_n)}")
    elif kind == "file":
        yield open_store(str(tmp_path / "store"))
    else:
        s3 = request.getfixturevalue("s3")
        yield open_store(s3.bucket(f"conformance-{next(_n)}") + "/root", s3.options())


def data_of(store, path):
    return store.read_all(path)


def test_staged_data_is_invisible_until_published(store):
    staged = store.stage("a/b.bin", [b"hello ", memoryview(b"world")], 11)
    assert not store.exists("a/b.bin")
    assert [e.path for e in store.walk() if not e.is_dir] == []
    store.publish(staged, "a/b.bin")
    assert data_of(store, "a/b.bin") == b"hello world"


def test_publish_replaces_whole(store):
    store.put("f", b"old contents, longer")
    staged = store.stage("f", [b"new"], 3)
    assert data_of(store, "f") == b"old contents, longer"
    store.publish(staged, "f")
    assert data_of(store, "f") == b"new"


@pytest.mark.parametrize("small_put", [8 << 20, 0], ids=["small", "multipart"])
def test_discard_leaves_nothing(store, monkeypatch, small_put):
    monkeypatch.setattr(backend_mod, "SMALL_PUT", small_put)
    staged = store.stage("gone", [b"x" * 1000], 1000)
    store.discard(staged)
    assert not store.exists("gone")
    assert [e for e in store.walk() if not e.is_dir] == []


def test_multi_part_upload(store, monkeypatch):
    monkeypatch.setattr(backend_mod, "PART_SIZE", 5 << 20)
    payload = os.urandom(12 << 20)
    pieces = [memoryview(payload)[i : i + (1 << 20)] for i in range(0, len(payload), 1 << 20)]
    store.publish(store.stage("big", pieces, len(payload)), "big")
    assert data_of(store, "big") == payload


def test_empty_file(store):
    store.publish(store.stage("empty", [], 0), "empty")
    assert data_of(store, "empty") == b""


def test_read_missing_raises_file_not_found(store):
    with pytest.raises(FileNotFoundError):
        data_of(store, "nope")


def test_delete_is_idempotent(store):
    store.put("d", b"1")
    store.delete("d")
    store.delete("d")
    assert not store.exists("d")


def test_move_and_copy(store):
    store.put("src/f", b"payload")
    store.copy("src/f", "copy/f")
    store.move("src/f", "dst/f")
    assert data_of(store, "copy/f") == b"payload" and data_of(store, "dst/f") == b"payload"
    assert not store.exists("src/f")


def test_walk_skips_ckptfs_prefix_and_find_includes_it(store):
    store.put("ckpt/model.pt", b"m")
    manifest.write(store, manifest.Record("ckpt/model.pt", "file", manifest.digest_of([b"m"])))
    files = sorted(e.path for e in store.walk() if not e.is_dir)
    assert files == ["ckpt/model.pt"]
    assert any(p.startswith(".ckptfs/files/") for p in store.find(".ckptfs"))
    assert manifest.read_all(store)["ckpt/model.pt"].current.size == 1


def test_sizes_from_walk(store):
    store.put("s", b"x" * 12345)
    assert {e.path: e.size for e in store.walk() if not e.is_dir} == {"s": 12345}


def test_records_round_trip(store):
    rec = manifest.Record("a/b", "file", manifest.Digest(3, "ab" * 16), manifest.Digest(2, "cd" * 16), 0o600, 42)
    manifest.write(store, rec)
    assert manifest.read(store, "a/b") == rec
    manifest.delete(store, "a/b")
    assert manifest.read(store, "a/b") is None


def test_walk_of_a_single_file(store):
    store.put("dir/one", b"1")
    store.put("dir/two", b"22")
    assert [(e.path, e.size) for e in store.walk("dir/two") if not e.is_dir] == [("dir/two", 2)]
