"""One conformance suite for the store adapter, run on every kind of store
(in the style of fsspec's tests/abstract): memory://, file://, s3:// on a
real S3 server on loopback and gs:// on a GCS emulator on loopback."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import time

import pytest
from ckptfs.writeback import backend as backend_mod
from ckptfs.writeback import localstore, manifest, objectstore
from ckptfs.writeback.backend import open_store

_n = itertools.count()


@pytest.fixture(params=["memory", "file", "s3", "gcs"])
def store(request, tmp_path):
    kind = request.param
    if kind == "memory":
        import fsspec

        fsspec.filesystem("memory").store.clear()  # global state: start clean
        yield open_store(f"memory://ckptfs-{next(_n)}")
    elif kind == "file":
        yield open_store(str(tmp_path / "store"))
    elif kind == "s3":
        s3 = request.getfixturevalue("s3")
        yield open_store(s3.bucket("conformance") + f"/root-{next(_n)}", s3.options())
    else:
        gcs = request.getfixturevalue("gcs")
        yield open_store(gcs.bucket("conformance") + f"/root-{next(_n)}", gcs.options())


def data_of(store, path):
    return store.read_all(path)


def publish(store, path, pieces) -> None:
    """As the engine does: stage (no name), then publish (the pieces again, for
    stores that PUT small files whole at publication)."""
    size = sum(len(p) for p in pieces)
    store.publish(store.stage(iter(pieces), size), path, iter(pieces))


def test_staged_data_is_invisible_until_published(store):
    pieces = [b"hello ", memoryview(b"world")]
    staged = store.stage(iter(pieces), 11)
    assert not store.exists("a/b.bin")
    assert [e.path for e in store.walk() if not e.is_dir] == []
    store.publish(staged, "a/b.bin", iter(pieces))
    assert data_of(store, "a/b.bin") == b"hello world"


def test_staging_is_bound_to_no_name(store):
    """A file renamed before its turn is published from the same staged copy."""
    staged = store.stage(iter([b"x" * 100]), 100)
    store.publish(staged, "final/name", iter([b"x" * 100]))
    assert data_of(store, "final/name") == b"x" * 100


def test_many_files_staged_at_once_are_each_invisible_until_published_at_any_name(store):
    """`stage_many`: a group's small files, in order, each its own staged copy."""
    contents = [b"", b"one", b"two" * 1000, bytes(range(256))]
    staged = store.stage_many([(iter([c]), len(c)) for c in contents])
    assert [s.size for s in staged] == [len(c) for c in contents]
    assert [e.path for e in store.walk() if not e.is_dir] == []
    for i, (s, c) in enumerate(reversed(list(zip(staged, contents, strict=True)))):
        store.publish(s, f"many/f{i}", iter([c]))
    assert [data_of(store, f"many/f{i}") for i in range(len(contents))] == contents[::-1]
    assert _no_litter(store)


def test_a_group_publishes_records_then_files_and_leaves_no_litter(store):
    """`publish_group`: records first, then every file, staged ahead or not
    (a `Staged` with no token is written from its bytes), replacing what is
    there; nothing left in staging."""
    store.put("g/old", b"replaced")
    big = [b"b" * 1000]
    small = [b"tiny", memoryview(b" file")]
    files = [(store.stage(iter(big), 1000), "g/big", 0o640, iter(big)),
             (backend_mod.Staged(9, None), "g/small", 0o600, iter(small)),
             (backend_mod.Staged(3, None), "g/old", None, iter([b"new"]))]
    records = [(f".ckptfs/files/t{i}.json", b"{}") for i in range(3)]
    store.publish_group(records, files)
    assert [data_of(store, p) for p in ("g/big", "g/small", "g/old")] == [b"b" * 1000, b"tiny file", b"new"]
    assert all(data_of(store, p) == b"{}" for p, _ in records)
    assert _no_litter(store)


def _no_litter(store) -> bool:
    uploads = list(store._uploads()) if hasattr(store, "_uploads") else []
    return store.find(".ckptfs/staging") == [] and uploads == []


@pytest.fixture
def multipart(monkeypatch):
    monkeypatch.setattr(objectstore, "PART_SIZE", 5 << 20)
    monkeypatch.setattr(objectstore, "SMALL_PUT", 0)
    return os.urandom(6 << 20)


def test_staged_at_its_name_is_invisible_until_published(store, multipart):
    """S3 leaves the upload open at the name and publishes by completing it (no copy)."""
    staged = store.stage(iter([multipart]), len(multipart), "ck/model.pt")
    assert not store.exists("ck/model.pt") and [e for e in store.walk() if not e.is_dir] == []
    assert store.staged_exists(staged.token)
    store.publish(staged, "ck/model.pt", iter([multipart]))
    assert data_of(store, "ck/model.pt") == multipart
    assert not store.staged_exists(staged.token) and _no_litter(store)
    with contextlib.suppress(FileNotFoundError):  # published already: fine again, or FileNotFoundError (the engine checks the bytes)
        store.publish(staged, "ck/model.pt", iter([multipart]))
    assert data_of(store, "ck/model.pt") == multipart


def test_staged_at_one_name_and_published_at_another(store, multipart):
    """Renamed before its turn: published whole at the new name, never seen at the old."""
    staged = store.stage(iter([multipart]), len(multipart), "ck/model.pt")
    store.publish(staged, "ck/renamed.pt", iter([multipart]))
    assert data_of(store, "ck/renamed.pt") == multipart and not store.exists("ck/model.pt")
    assert _no_litter(store)


def test_a_group_publishes_a_file_staged_at_one_name_at_another(store, multipart):
    """A group commit (`storeio.publish_group`) of files renamed before their
    turn (a directory renamed after its files were staged, Orbax's or a
    move on a cluster node): S3 uploads each again at its new name, from the
    bytes, which the group must hand it (it had none: the object was empty)."""
    from ckptfs.writeback import storeio
    from ckptfs.writeback.manifest import Record, digest_of

    staged = store.stage(iter([multipart]), len(multipart), "d/model.pt")
    small = backend_mod.Staged(5, None)
    items = [(Record.of("moved/model.pt", "file", manifest.Meta(0o644), current=digest_of([multipart])), staged, "moved/model.pt",
              lambda: iter([multipart])),
             (Record.of("moved/x", "file", manifest.Meta(0o644), current=digest_of([b"small"])), small, "moved/x", lambda: iter([b"small"]))]
    storeio.publish_group(store, items)
    assert data_of(store, "moved/model.pt") == multipart and data_of(store, "moved/x") == b"small"
    assert not store.exists("d/model.pt") and _no_litter(store)


def test_a_temporary_name_is_staged_under_a_hidden_one(store, multipart):
    staged = store.stage(iter([multipart]), len(multipart), "1.orbax-checkpoint-tmp-7/d/x")
    assert staged.at is None
    store.publish(staged, "1/d/x", iter([multipart]))
    assert data_of(store, "1/d/x") == multipart and _no_litter(store)


def test_discarding_an_upload_staged_at_a_name_leaves_nothing(store, multipart):
    staged = store.stage(iter([multipart]), len(multipart), "ck/model.pt")
    store.discard(staged)
    assert not store.exists("ck/model.pt") and _no_litter(store)


def test_a_crash_between_record_and_publication_is_a_leftover(store, multipart):
    """kill -9 after the record was written, before the staged data was made
    visible: the next daemon's scan removes the record, and its claim of the
    store removes the staged data (an open S3 upload too)."""
    from ckptfs.writeback import storeio

    store.prepare("crashed-one", time.time())
    staged = store.stage(iter([multipart]), len(multipart), "ck/model.pt")
    digest = manifest.digest_of([multipart])
    manifest.write(store, manifest.Record("ck/model.pt", "file", digest, source=f"staged:{staged.token}"))
    store.delete(".ckptfs/daemons/crashed-one")  # dead: no heartbeat
    time.sleep(1.1)  # the newcomer starts after the crashed one's upload began
    newcomer = type(store).__new__(type(store))
    newcomer.__dict__.update(store.__dict__)
    records = storeio.scan(newcomer).records
    assert "ck/model.pt" not in records and manifest.read(newcomer, "ck/model.pt") is None
    newcomer.prepare("newcomer", time.time())
    assert not newcomer.exists("ck/model.pt") and _no_litter(newcomer)


def test_publish_replaces_whole(store):
    store.put("f", b"old contents, longer")
    staged = store.stage(iter([b"new"]), 3)
    assert data_of(store, "f") == b"old contents, longer"
    store.publish(staged, "f", iter([b"new"]))
    assert data_of(store, "f") == b"new"


@pytest.mark.parametrize("small_put", [8 << 20, 0], ids=["small", "multipart"])
def test_discard_leaves_nothing(store, monkeypatch, small_put):
    monkeypatch.setattr(objectstore, "SMALL_PUT", small_put)
    store.prepare("conformance", time.time())
    staged = store.stage(iter([b"x" * 1000]), 1000)
    store.discard(staged)
    assert not store.exists("gone")
    assert [e for e in store.walk() if not e.is_dir] == []
    assert [p for p in store.find(".ckptfs/staging")] == []


def test_multi_part_upload(store, monkeypatch):
    monkeypatch.setattr(objectstore, "PART_SIZE", 5 << 20)
    monkeypatch.setattr(objectstore, "SMALL_PUT", 1 << 20)
    payload = os.urandom(12 << 20)
    publish(store, "big", [memoryview(payload)[i : i + (1 << 20)] for i in range(0, len(payload), 1 << 20)])
    assert data_of(store, "big") == payload


def test_the_parts_of_one_file_upload_concurrently_and_land_in_order(s3, tmp_path, monkeypatch):
    """S3: one large file's parts are in flight together (up to
    PART_CONCURRENCY), and the object is the bytes in order."""
    import threading

    monkeypatch.setattr(objectstore, "PART_SIZE", 5 << 20)
    monkeypatch.setattr(objectstore, "SMALL_PUT", 1 << 20)
    store = open_store(s3.bucket("parts") + f"/root-{next(_n)}", s3.options())
    lock, now, most = threading.Lock(), [0], [0]
    send = type(store)._part

    def part(self, *args):  # the real upload, with a note of how many run at once
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            time.sleep(0.1)
            return send(self, *args)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(type(store), "_part", part)
    payload = os.urandom(31 << 20)  # 7 parts, the last one short
    publish(store, "big", [memoryview(payload)[i : i + (1 << 20)] for i in range(0, len(payload), 1 << 20)])
    assert data_of(store, "big") == payload
    assert most[0] == objectstore.PART_CONCURRENCY


def test_empty_file(store):
    publish(store, "empty", [])
    assert data_of(store, "empty") == b""


def test_exchange_swaps_two_files(store):
    if not store.dirs:
        pytest.skip("an object store's exchange is the publisher's, through hidden names")
    store.put("x", b"XXX")
    store.put("y", b"y")
    store.exchange("x", "y")
    assert data_of(store, "x") == b"y" and data_of(store, "y") == b"XXX"


def test_directories_move_whole_where_the_store_has_them(store):
    store.put("tmp/a", b"a")
    store.put("tmp/sub/b", b"b")
    if not store.dirs:
        assert store.unit_dir() is None and store.move_dir("tmp", "final") is False
        return
    assert store.move_dir("tmp", "final")
    assert data_of(store, "final/sub/b") == b"b" and not store.exists("tmp")
    unit = store.unit_dir()
    assert unit.startswith(".ckptfs/staging/") and [e for e in store.walk() if e.path.startswith(".ckptfs")] == []


def test_a_new_daemon_cleans_only_what_dead_daemons_left(store):
    live = store
    live.prepare("live-one", time.time())
    live_staged = live.stage(iter([b"l" * 10]), -1)  # -1: uploaded ahead on every store
    other = type(store).__new__(type(store))
    other.__dict__.update(store.__dict__)
    other.daemon_id = "dead-one"
    store.put(f".ckptfs/staging/dead-one/{'0' * 32}", b"litter")
    store.put(".ckptfs/daemons/dead-one", b'{"time": 0}')
    newcomer = type(store).__new__(type(store))
    newcomer.__dict__.update(store.__dict__)
    newcomer.prepare("newcomer", time.time())
    left = store.find(".ckptfs/staging")
    assert live_staged.token in left and not any("dead-one" in p for p in left)
    assert not store.exists(".ckptfs/daemons/dead-one")
    live.retire()
    assert live_staged.token not in store.find(".ckptfs/staging")


def test_read_missing_raises_file_not_found(store):
    with pytest.raises(FileNotFoundError):
        data_of(store, "nope")


def test_delete_is_idempotent(store):
    store.put("d", b"1")
    store.delete("d")
    store.delete("d")
    assert not store.exists("d")


def test_delete_many_deletes_exactly_the_paths_named(store, monkeypatch):
    """Names holding `*`, `?` or `[` are names, never patterns; missing
    ones are no error; S3 sends DELETE_MANY keys a request."""
    monkeypatch.setattr(objectstore, "DELETE_MANY", 3)
    names = ["a", "d/b", "x*", "x?y", "x[1]", "xyz", "x1", "keep/c"]
    for name in names:
        store.put(name, name.encode())
    store.delete_many(["a", "d/b", "x*", "x?y", "x[1]", "missing", "d/missing"])
    assert sorted(p for p in store.find("") if not p.startswith(".ckptfs/")) == ["keep/c", "x1", "xyz"]


def test_a_group_on_s3_sends_its_records_together_then_its_files_together(s3, monkeypatch):
    """S3: a group commit's requests go side by side (GROUP_CONCURRENCY at
    a time), every record before any file: one after another, small files
    were published at 80 a second."""
    import threading

    store = open_store(s3.bucket("groups") + f"/root-{next(_n)}", s3.options())
    lock, now, most, order = threading.Lock(), {"put": 0, "publish": 0}, {"put": 0, "publish": 0}, []
    kind = type(store)

    def noted(name, real):
        def call(self, *args, **kwargs):  # the real request, with a note of how many run at once and when
            with lock:
                now[name] += 1
                most[name] = max(most[name], now[name])
                order.append(name)
            try:
                time.sleep(0.05)
                return real(self, *args, **kwargs)
            finally:
                with lock:
                    now[name] -= 1
        return call

    monkeypatch.setattr(kind, "put", noted("put", kind.put))
    monkeypatch.setattr(kind, "publish", noted("publish", kind.publish))
    records = [(f".ckptfs/files/g{i}.json", b"{}") for i in range(20)]
    files = [(backend_mod.Staged(4, None), f"g/f{i}", 0o644, iter([b"%04d" % i])) for i in range(20)]
    store.publish_group(records, files)
    assert [data_of(store, f"g/f{i}") for i in range(20)] == [b"%04d" % i for i in range(20)]
    assert order == ["put"] * 20 + ["publish"] * 20
    assert all(1 < n <= objectstore.GROUP_CONCURRENCY for n in most.values()), most


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
    assert manifest.read_all(store)[0]["ckpt/model.pt"].current.size == 1


def test_sizes_from_walk(store):
    store.put("s", b"x" * 12345)
    assert {e.path: e.size for e in store.walk() if not e.is_dir} == {"s": 12345}


def test_records_round_trip(store):
    rec = manifest.Record("a/b", "file", manifest.Digest(3, "ab" * 16), manifest.Digest(2, "cd" * 16), 0o600, 42)
    manifest.write(store, rec)
    assert manifest.read(store, "a/b") == rec
    manifest.delete(store, "a/b")
    assert manifest.read(store, "a/b") is None


@pytest.mark.parametrize("data", [b"x\r", b"x\r\n", bytes(range(256))], ids=["cr", "crlf", "every-byte"])
def test_put_keeps_every_byte(store, data):
    """What `put` writes (records, and the manifest image: compressed, so any
    bytes) reads back exactly, whatever its last bytes are; an emulator that
    parsed uploads by lines once lost a trailing CR."""
    store.put("blob", data)
    assert store.read_all("blob") == data
    publish(store, "file", [data])
    assert store.read_all("file") == data


def test_walk_of_a_single_file(store):
    store.put("dir/one", b"1")
    store.put("dir/two", b"22")
    assert [(e.path, e.size) for e in store.walk("dir/two") if not e.is_dir] == [("dir/two", 2)]


def test_read_many_returns_what_is_there_and_leaves_out_what_is_not(store):
    """A restart reads every record at once (`read_many`: one directory
    descriptor per directory, or concurrent requests): the contents of each
    file asked for, missing ones left out, in any number."""
    names = [f"r/{i % 7}/{i}.json" for i in range(objectstore.READ_MANY_BATCH + 50)]  # more than one batch on object stores
    contents = {name: str(i).encode() * (i % 5 + 1) for i, name in enumerate(names)}
    if isinstance(store, objectstore.FsspecBackend):
        store.fs.pipe({store._abs(name): data for name, data in contents.items()})  # concurrently: set-up only
    else:
        for name, data in contents.items():
            store.put(name, data)
    asked = [*names, "r/0/missing.json", "nowhere/x.json"]
    got = dict(store.read_many(asked))
    assert got == contents


def test_a_source_reads_any_range_in_any_order(store):
    """Loads read the block a reader waits for first (`open_source`): any
    range, in any order, the bytes as published; on a local store straight
    into the caller's buffer where it gives one; a missing file is
    FileNotFoundError."""
    payload = os.urandom(3 << 20)
    publish(store, "f", [payload])
    with store.open_source("f") as source:
        assert source.size == len(payload)
        for off, n in ((2 << 20, 1 << 20), (5, 100), (0, 1 << 20), (len(payload) - 1, 1)):
            assert b"".join(bytes(p) for p in source.read(off, n)) == payload[off : off + n]
        buf = bytearray(1 << 20)
        got = list(source.read(1 << 20, 1 << 20, lambda off, k: memoryview(buf)[: min(k, len(buf))]))
        assert b"".join(bytes(p) for p in got) == payload[1 << 20 : 2 << 20]
        if isinstance(store, localstore.LocalBackend):
            assert bytes(buf) == payload[1 << 20 : 2 << 20]  # read in place
    with pytest.raises(FileNotFoundError):
        store.open_source("missing")


@pytest.mark.parametrize("kind", ["memory", "file", "s3", "gcs"])
def test_what_another_client_wrote_is_seen_at_once(kind, request, tmp_path):
    """A store is shared: by a cluster's nodes, by `verify`, by the tools
    that read a checkpoint where it is stored. One client's listing, test
    of a name and size of a file follow what another wrote after it looked
    (no listing kept from before: gcsfs keeps one unless told not to)."""
    if kind == "memory":
        import fsspec

        fsspec.filesystem("memory").store.clear()
        url, options = f"memory://ckptfs-{next(_n)}", {}
    elif kind == "file":
        url, options = str(tmp_path / "store"), {}
    else:
        server = request.getfixturevalue(kind)
        url, options = server.bucket("shared") + f"/root-{next(_n)}", server.options()
    a = open_store(url, options)
    b = open_store(url, {**options, "skip_instance_cache": True} if kind in ("s3", "gcs") else options)  # as in another process
    a.put("x/one", b"1")
    publish(a, "top", [b"t"])
    assert (a.exists("x/two"), sorted(e.path for e in a.walk() if not e.is_dir)) == (False, ["top", "x/one"])
    with a.open_source("x/one") as source:
        assert source.size == 1
    b.put("x/two", b"22")
    publish(b, "x/one", [b"longer"])
    publish(b, "new", [b"n"])
    assert (a.exists("x/two"), sorted(e.path for e in a.walk() if not e.is_dir)) == (True, ["new", "top", "x/one", "x/two"])
    with a.open_source("x/one") as source:
        assert source.size == 6 and b"".join(bytes(p) for p in source.read(0, 6)) == b"longer"


def test_records_a_burst_of_reads_could_not_get_are_read_again(tmp_path):
    """An object store under a burst of reads (a restart reading every
    record) can answer some with an error (S3's 503 Slow Down, SeaweedFS's
    500 while its volumes register): those are read again, not the whole
    scan failed."""
    from fsspec.implementations.memory import MemoryFileSystem

    class Overloaded(MemoryFileSystem):
        refused: set[str] = set()

        def cat_file(self, path, start=None, end=None, **kwargs):
            if not path.endswith("/r1") and path not in self.refused:  # every object's first read but one
                self.refused.add(path)
                raise OSError(errno.EIO, "slow down")
            return super().cat_file(path, start, end, **kwargs)

    fs = Overloaded()
    root = f"/{tmp_path.name}-overloaded"
    try:
        for i in range(5):
            fs.pipe_file(f"{root}/r{i}", b"%d" % i)
        backend = objectstore.FsspecBackend(fs, root, f"memory:/{root}")
        assert dict(backend.read_many([f"r{i}" for i in range(6)])) == {f"r{i}": b"%d" % i for i in range(5)}  # r5: missing
    finally:
        fs.rm(root, recursive=True)
