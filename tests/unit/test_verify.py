"""`verify` of a store that a daemon publishes into meanwhile: what changed
while it ran is looked at again, and only what stays wrong is reported."""

from __future__ import annotations

import os
import shutil

from ckptfs.writeback import manifest, storeio
from ckptfs.writeback.backend import open_store
from ckptfs.writeback.manifest import Meta, Record
from ckptfs.writeback.verify import verify


def test_files_published_moved_and_deleted_while_verified_are_not_reported(tmp_path):
    """Every record was read first, then every file: a file published twice
    since read as CORRUPT against its record of before, one moved or deleted
    since as MISSING (`ckptfs verify` of a live mount failed 39 runs in 104)."""
    store = open_store(str(tmp_path / "store"))
    storeio.write_file(store, "a.bin", b"gen 1" * 1000)
    storeio.write_file(store, "b/x.bin", b"x" * 3000)
    storeio.write_file(store, "z.bin", b"z" * 2000)
    changed = []

    def meanwhile(path: str, size: int) -> None:
        if changed:
            return
        changed.append(path)
        storeio.write_file(store, "a.bin", b"gen 2" * 1000)
        storeio.write_file(store, "a.bin", b"gen 3" * 2000)
        moved = manifest.read(store, "b/x.bin")
        storeio.show(store, Record.of("y/x.bin", "file", Meta(), current=moved.current), "b/x.bin", "y/x.bin", True)
        storeio.delete(store, "z.bin")

    report = verify(store, progress=meanwhile)
    assert changed and report.clean, (report.corrupt, report.missing, report.extra)
    assert "a.bin" in report.ok
    assert verify(store).clean and sorted(verify(store).ok) == ["a.bin", "y/x.bin"]


def test_what_stays_wrong_is_still_reported(tmp_path):
    root = tmp_path / "store"
    store = open_store(str(root))
    for name in ("rotten.bin", "lost.bin", "fine.bin"):
        storeio.write_file(store, name, name.encode() * 100)
    (root / "rotten.bin").write_bytes(b"x" * len(b"rotten.bin" * 100))
    (root / "lost.bin").unlink()
    (root / "planted.bin").write_bytes(b"not written by ckptfs")
    storeio.write_file(store, "d/under.bin", b"u" * 100)
    shutil.rmtree(root / "d")
    (root / "d").symlink_to(tmp_path)  # planted where its directory was: never followed
    report = verify(store)
    assert [p for p, _ in report.corrupt] == ["rotten.bin"] and "manifest says" in report.corrupt[0][1]
    assert report.missing == ["d/under.bin", "lost.bin"] and report.extra == ["planted.bin"] and report.ok == ["fine.bin"]


def test_a_record_whose_block_hashes_do_not_match_its_file_is_reported(tmp_path):
    """A load checks each block against the record's hash of it: a record
    whose whole hash matches the file but one block's does not (damaged)
    fails its loads, and `verify` says so, for blocks of 16 MiB and for the
    64 MiB blocks of records written before them (hashed as they were)."""
    store = open_store(str(tmp_path / "store"))
    data = bytes(range(256)) * ((manifest.OLD_BLOCK + (1 << 20)) // 256)  # 65 MiB: 5 blocks now, 2 of before
    for name in ("damaged.bin", "fine.bin", "before.bin", "before-damaged.bin"):
        storeio.write_file(store, name, data)
    rec = manifest.read(store, "damaged.bin")
    assert len(rec.current.blocks) == 5
    manifest.write(store, rec._replace(current=rec.current._replace(blocks=(*rec.current.blocks[:3], "0" * 32, rec.current.blocks[4]))))
    old = manifest.digest_of([data], manifest.OLD_BLOCK)
    assert old.block_size == manifest.OLD_BLOCK and len(old.blocks) == 2
    manifest.write(store, manifest.read(store, "before.bin")._replace(current=old))
    manifest.write(store, manifest.read(store, "before-damaged.bin")._replace(current=old._replace(blocks=(old.blocks[0], "1" * 32))))
    report = verify(store)
    assert sorted(report.ok) == ["before.bin", "fine.bin"]
    assert sorted((p, why.split(" (")[0].split(", but ")[1]) for p, why in report.corrupt) == [
        ("before-damaged.bin", "block 1"), ("damaged.bin", "block 3")]
    assert not report.missing and not report.extra


def test_a_record_whose_lead_hash_does_not_match_its_file_is_reported(tmp_path):
    """A load serves a file's first MiB once it matches the record's hash
    of it: a record whose whole hash matches but whose lead's does not
    (damaged) fails every load of the file, and `verify` says so."""
    store = open_store(str(tmp_path / "store"))
    data = os.urandom(3 << 20)
    for name in ("damaged.bin", "fine.bin"):
        storeio.write_file(store, name, data)
    rec = manifest.read(store, "damaged.bin")
    assert rec.current.lead
    manifest.write(store, rec._replace(current=rec.current._replace(lead="0" * 32)))
    report = verify(store)
    assert report.ok == ["fine.bin"] and [p for p, _ in report.corrupt] == ["damaged.bin"]
    assert f"its first {manifest.LEAD} bytes not the record's hash" in report.corrupt[0][1]


def test_a_file_the_store_cannot_read_is_reported_and_the_others_verified(tmp_path):
    """A store file that fails to read (EIO: a bad sector, a broken object)
    is reported as corrupt, and the rest of the store verified: `verify`
    stopped at it ("the store failed while it was verified")."""
    import errno

    store = open_store(str(tmp_path / "store"))
    for name in ("a.bin", "bad.bin", "z.bin"):
        storeio.write_file(store, name, name.encode() * 100)
    real = store.read

    def read(path):
        if path == "bad.bin":
            raise OSError(errno.EIO, "Input/output error", path)
        return real(path)

    store.read = read
    report = verify(store)
    assert report.corrupt == [("bad.bin", "its bytes cannot be read from the store (Input/output error)")]
    assert sorted(report.ok) == ["a.bin", "z.bin"] and not report.missing and not report.extra


def test_a_store_error_whose_class_takes_other_arguments_is_said_naming_the_file(tmp_path):
    """A store error naming its file again was made of the error's own
    class, given (errno, message): one whose constructor takes other
    arguments (here the deadline's StoreTimeout) raised a ValueError
    instead, and `ckptfs verify` ended in a traceback."""
    import errno

    import pytest
    from ckptfs.writeback.calls import StoreTimeout

    store = open_store(str(tmp_path / "store"))
    storeio.write_file(store, "a.bin", b"a" * 100)

    def read(path):
        raise StoreTimeout(f"read {path}", 60.0)

    store.read = read
    with pytest.raises(OSError) as failed:
        verify(store)
    assert failed.value.errno == errno.ETIMEDOUT and "cannot read a.bin" in str(failed.value)
