"""The manifest image (manifest.Image): a daemon saves every record in one
object now and then, so a restart after a crash reads only the record
objects changed since the last save, as the store's times tell, and still
shows every record as it is."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import trio
import xxhash
from ckptfs.writeback import manifest
from ckptfs.writeback.backend import IMAGE, INDEX, new_daemon_id

from tests.storeutil import image_in
from tests.unit.test_convergence import _mount_view, _restarted_view, _store
from tests.unit.test_engine import Rig, run_until_flushed


async def _started(url) -> Rig:
    rig = Rig(url, claim=False)
    await rig.engine.scan()
    await rig.engine.claim(new_daemon_id(), time.time())
    return rig


async def _five_files(url, monkeypatch) -> Rig:
    """A started rig, five files published; restarts rely on its image with no margin for the store's clock."""
    monkeypatch.setattr(manifest, "CLOCK_MARGIN_S", 0.0)
    rig = await _started(url)
    for i in range(5):
        rig.write(f"f{i}", b"x" * i)
    await run_until_flushed(rig)
    time.sleep(0.05)  # past the granularity of a local file's ctime: the records are older than an image saved now
    return rig


def _reading(rig: Rig) -> list[str]:
    """Every object the rig's backend reads in bulk (record objects), from now on."""
    read: list[str] = []
    real = rig.backend.read_many

    def read_many(paths):
        read.extend(paths)
        return real(paths)

    rig.backend.read_many = read_many
    return read


@pytest.mark.parametrize("kind", ["local", "object"])
async def test_a_restart_after_a_crash_reads_only_the_records_changed_since_the_image(tmp_path, kind, monkeypatch):
    monkeypatch.setattr(manifest, "CLOCK_MARGIN_S", 0.0)
    url = _store(tmp_path, kind)
    rig = await _started(url)
    for i in range(20):
        rig.write(f"f{i}", bytes([i]) * (100 + i))
    await run_until_flushed(rig)
    time.sleep(0.05)  # past the granularity of a local file's ctime: the records are older than the image
    await rig.engine.save_image(IMAGE)
    time.sleep(0.05)  # past the granularity of a local file system's times

    rig.write("f1", b"new" * 50)  # rewritten
    rig.unlink("f2")
    rig.store.setattr(rig.store.inode_at("f3").ino, mode=0o600)
    rig.rename("f4", "g4")
    rig.write("f20", b"added")
    await run_until_flushed(rig)
    view = _mount_view(rig.store, with_data=True)
    # killed: no index left, only the image

    again = Rig(url, claim=False)
    read = _reading(again)
    await again.engine.scan()
    # those of the files changed, and the root's (its mtime changed)
    assert sorted(read) == sorted(manifest.record_path(p) for p in ("f1", "f3", "g4", "f20", ""))
    assert await _restarted_view(tmp_path, str(url)) == view  # every file loads, verified, with its mode


@pytest.mark.parametrize("kind", ["local", "object"])
async def test_a_record_change_under_way_while_the_image_is_saved_is_left_out_and_is_in_the_next_save(tmp_path, kind, monkeypatch):
    """A record write under way while the image is saved (begun before the
    image's time) may land after the save: the image leaves the record out
    (an object store may date the write by when its request began, before
    the image's time), so a restart reads it; the next save has it."""
    monkeypatch.setattr(manifest, "CLOCK_MARGIN_S", 0.0)
    url = _store(tmp_path, kind)
    rig = await _started(url)
    rig.write("a", b"1" * 100)
    await run_until_flushed(rig)
    old = manifest.read(rig.backend, "a")
    changed = manifest.Record.of("a", "file", old.meta, current=manifest.digest_of([b"2" * 100]))
    gate = threading.Event()
    real_put = rig.backend.put

    def put(path, data):
        if path == manifest.record_path("a"):
            gate.wait(10)
        real_put(path, data)

    rig.backend.put = put
    writer = threading.Thread(target=manifest.write, args=(rig.backend, changed))
    writer.start()
    while manifest.record_path("a") not in rig.backend.records_changed.under_way():
        time.sleep(0.001)
    await rig.engine.save_image(IMAGE)
    gate.set()  # the write lands after the save
    writer.join()
    rig.backend.put = real_put
    assert manifest.record_path("a") not in image_in(rig.backend, IMAGE).objects
    time.sleep(0.05)
    await rig.engine.save_image(IMAGE)  # the next save
    assert image_in(rig.backend, IMAGE).objects[manifest.record_path("a")].current == changed.current

    again = Rig(url, claim=False)
    await again.engine.scan()
    assert again.engine.residency._expected[again.store.inode_at("a").ino].current == changed.current


@pytest.mark.parametrize("kind", ["local", "object"])
async def test_an_image_save_takes_the_records_the_daemon_wrote_and_reads_only_those_whose_write_failed(tmp_path, kind, monkeypatch):
    """A save does not read back what this daemon's calls wrote: it knows
    it. A call that failed may or may not have landed (a timeout, a lost
    answer): that record is read again, and the image holds what landed."""
    monkeypatch.setattr(manifest, "CLOCK_MARGIN_S", 0.0)
    url = _store(tmp_path, kind)
    rig = await _started(url)
    for i in range(5):
        rig.write(f"f{i}", b"x" * (i + 1))
    await run_until_flushed(rig)
    rig.unlink("f4")
    await run_until_flushed(rig)
    read = _reading(rig)
    await rig.engine.save_image(IMAGE)
    assert read == []
    image = image_in(rig.backend, IMAGE).records()[0]
    assert sorted(p for p, r in image.items() if r.kind == "file") == ["f0", "f1", "f2", "f3"]
    assert image == manifest.read_all(rig.backend)[0]

    landed = manifest.Record.of("f1", "file", image["f1"].meta, current=manifest.digest_of([b"landed"]))
    real_put = rig.backend.put

    def put(path, data):  # lands, then the answer is lost
        real_put(path, data)
        if path == manifest.record_path("f1"):
            raise TimeoutError("the answer was lost")

    rig.backend.put = put
    with pytest.raises(TimeoutError):
        manifest.write(rig.backend, landed)
    rig.backend.put = real_put
    time.sleep(0.05)
    read.clear()
    await rig.engine.save_image(IMAGE)
    assert read == [manifest.record_path("f1")]
    assert image_in(rig.backend, IMAGE).records()[0]["f1"].current == landed.current


@pytest.mark.parametrize("kind", ["local", "object"])
async def test_a_clean_exit_while_an_image_is_saved_leaves_an_index_with_the_records_that_save_took(tmp_path, kind):
    """The daemon saves its image now and then until it exits. An exit
    during a save found no record changes noted (the save had taken them)
    and left the last image, without them, as the exact index: a restart
    over a store of 100,000 files showed 22,488 of them with no record (no
    checksum to verify their loads with; modes, owners and times lost)."""
    url = _store(tmp_path, kind)
    rig = await _started(url)
    await rig.engine.save_image(IMAGE)  # as a daemon does at once: its image has a time from now on
    rig.write("a", b"1" * 100)
    await run_until_flushed(rig)
    saving, go_on = threading.Event(), threading.Event()
    real_put = rig.backend.put

    def put(path, data):
        if path == IMAGE:
            saving.set()
            go_on.wait(10)
        real_put(path, data)

    rig.backend.put = put
    try:
        async with trio.open_nursery() as n:
            n.start_soon(rig.engine.save_image, IMAGE)
            await trio.to_thread.run_sync(saving.wait, 10)  # it has taken the record of `a`, and writes the image
            n.start_soon(rig.engine.leave_index)
            await trio.sleep(0.3)
            go_on.set()
    finally:
        go_on.set()
        rig.backend.put = real_put
    assert manifest.record_path("a") in image_in(rig.backend, INDEX).objects

    again = Rig(url, claim=False)
    await again.engine.scan()
    assert again.engine.residency._expected[again.store.inode_at("a").ino].current == manifest.digest_of([b"1" * 100])


async def test_a_clean_exit_waits_for_an_image_save_under_way_before_the_daemon_retires(tmp_path):
    """An image save staged in this daemon's staging when the exit began:
    `leave_index` had nothing to leave (a helper had written to the store
    without the daemon, and the save had taken the record changes) and the
    daemon retired at once, its staging with the staged image: "cannot
    save the manifest image: No such file or directory" (seen in CI)."""
    url = _store(tmp_path, "local")
    rig = await _started(url)
    await rig.engine.save_image(IMAGE)
    rig.write("a", b"1" * 100)
    await run_until_flushed(rig)
    manifest.mark_outside(rig.backend)  # a helper wrote to the store straight: no exact index at the exit
    staged, go_on = threading.Event(), threading.Event()
    real_publish = rig.backend.publish

    def publish(staged_file, path, *args, **kw):
        if path == IMAGE:
            staged.set()
            go_on.wait(10)
        return real_publish(staged_file, path, *args, **kw)

    failed: list[Exception] = []

    async def keep_image():
        try:
            await rig.engine.save_image(IMAGE, background=True)
        except Exception as exc:
            failed.append(exc)

    async def leave():
        await rig.engine.leave_index()
        await rig.engine.calls.run("retire", rig.backend.retire)

    rig.backend.publish = publish
    try:
        async with trio.open_nursery() as n:
            n.start_soon(keep_image)
            await trio.to_thread.run_sync(staged.wait, 10)  # the image is staged, not yet in place
            n.start_soon(leave)
            await trio.sleep(0.3)
            go_on.set()
    finally:
        go_on.set()
        rig.backend.publish = real_publish
    assert not failed
    assert manifest.record_path("a") in image_in(rig.backend, IMAGE).objects


async def test_a_file_an_index_on_an_object_store_left_without_its_record_is_verified_at_its_first_load(tmp_path):
    """An index short of a record (a daemon before 39c688d could leave one,
    and every clean exit after kept it): on an object store the scan does
    not look for the records the index does not name (a request per file
    not written by ckptfs, at every restart), so the file's first load
    does. Damaged bytes are an error, not served."""
    import errno

    url = _store(tmp_path, "object")
    rig = await _started(url)
    rig.write("b", b"b" * 5000)
    await run_until_flushed(rig)
    await rig.engine.leave_index()
    index = image_in(rig.backend)
    index.forget([manifest.record_path("b")])
    rig.backend.put(INDEX, index.packed())  # b's record object is there, its row is not
    rig.backend.put("b", b"B" * 5000)  # and the store's copy went bad since

    again = Rig(url, claim=False)
    await again.engine.scan()
    with pytest.raises(OSError) as got:
        await again.engine.load(again.store.inode_at("b").ino)
    assert got.value.errno == errno.EIO


async def test_a_clean_exit_leaves_an_exact_index_that_a_claim_turns_into_the_image(tmp_path, monkeypatch):
    url = tmp_path / "store"
    rig = await _five_files(url, monkeypatch)
    await rig.engine.leave_index()
    assert (url / INDEX).is_file() and not (url / IMAGE).exists()

    again = Rig(url, claim=False)
    read = _reading(again)
    await again.engine.scan()
    assert read == []  # exact: no record read
    await again.engine.claim(new_daemon_id(), time.time())
    assert not (url / INDEX).exists() and (url / IMAGE).is_file()
    time.sleep(0.05)
    again.write("f1", b"changed")
    async with trio.open_nursery() as n:  # published, then killed
        await n.start(again.engine.run)
        await again.engine.flush()
        n.cancel_scope.cancel()

    third = Rig(url, claim=False)
    read = _reading(third)
    await third.engine.scan()
    assert manifest.record_path("f1") in read and set(read) <= {manifest.record_path("f1"), manifest.record_path("")}  # and the root's, if recorded again


async def test_after_a_write_without_a_daemon_a_restart_reads_every_record(tmp_path, monkeypatch):
    """The torch helpers write straight to the store when the daemon does
    not answer: one that hung may save its image after such a write, which
    its image then lacks, dated after it. A mark of such a write makes a
    restart read every record, image or not."""
    from ckptfs.writeback import storeio

    url = tmp_path / "store"
    rig = await _five_files(url, monkeypatch)
    outside = Rig(url, claim=False)  # a backend with no daemon: the helpers'
    storeio.write_file(outside.backend, "f1", b"written by the helpers")
    time.sleep(0.05)
    await rig.engine.save_image(IMAGE)  # the hung daemon goes on
    again = Rig(url, claim=False)
    read = _reading(again)
    await again.engine.scan()
    assert manifest.record_path("f1") in read and len(read) >= 6  # every record: the files' and the root's
    assert again.engine.residency._expected[again.store.inode_at("f1").ino].current == manifest.digest_of([b"written by the helpers"])


async def test_a_store_that_is_down_is_asked_to_save_the_image_less_and_less_often(tmp_path, monkeypatch):
    from ckptfs.writeback import engine as engine_module

    from tests.unit.test_engine import FaultyBackend

    monkeypatch.setattr(engine_module, "IMAGE_CHECK_S", 0.01)
    monkeypatch.setattr(engine_module, "IMAGE_RETRY_MAX_S", 10.0)
    rig = await _started(tmp_path / "store")
    down = FaultyBackend(rig.backend, error_rate=0.0, latency_s=0.0)
    down.down = True
    rig.engine.backend = down
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        await trio.sleep(1.0)
        n.cancel_scope.cancel()
    # waits of 0.01, 0.02, 0.04 ... s: about 7 tries in a second (100 at a fixed 0.01 s)
    assert 3 <= down.calls <= 12, down.calls


async def test_objects_with_planted_names_among_the_records_do_not_stop_a_restart(tmp_path, monkeypatch):
    """The store is input: files under the records' prefix whose names no
    record has (bytes that are not UTF-8, a newline) are not records, and
    neither the scan nor the image it keeps trips over them."""
    import os

    url = tmp_path / "store"
    rig = await _five_files(url, monkeypatch)
    await rig.engine.save_image(IMAGE)
    files = os.fsencode(url / manifest.PREFIX)
    for name in (b"\xff\xfe.json", b"a\nb.json", b"x\ty.json"):
        with open(os.path.join(files, name), "wb") as f:
            f.write(b"{}")
    again = Rig(url, claim=False)
    assert await again.engine.scan() == 5
    assert manifest.Image.unpacked(again.engine._image).objects.keys() == image_in(rig.backend, IMAGE).objects.keys()


@pytest.mark.parametrize("index", [True, False], ids=["from the index", "from the record objects"])
async def test_records_with_fields_ckptfs_never_writes_read_as_unreadable(tmp_path, index):
    """A record whose mode is a string, whose owner or time no file system
    can hold, or whose digest is no digest (another tool, a torn write, or
    someone hostile) used to fail the restart with a TypeError. In the index,
    such a row makes the index untrusted (the record objects are read); as a
    record object, the file is shown and loading it is an error, as for a
    record that is not JSON. A new save writes a good record over a bad one."""
    url = tmp_path / "store"
    rig = await _started(url)
    names = ("mode", "owner", "time", "digest", "good")
    for name in names:
        rig.write(name, name.encode())
    await run_until_flushed(rig)
    await rig.engine.leave_index()
    bad = {"mode": {"mode": "x"}, "owner": {"uid": 1 << 40}, "time": {"mtime_ns": 10**30}, "digest": {"current": [-1, 7, []]}}
    if index:
        since, lines = manifest._lines((url / INDEX).read_bytes())
        for i, line in enumerate(lines):
            key, _, row = line.partition(b"\t")
            values = json.loads(row)
            for k, v in bad.get(values[0], {}).items():
                values[manifest.Record._fields.index(k)] = v
            lines[i] = key + b"\t" + json.dumps(values).encode()
        (url / INDEX).write_bytes(manifest._pack(since, lines))
    else:
        (url / INDEX).unlink()
        for path, fields in bad.items():
            obj = url / manifest.record_path(path)
            d = {**json.loads(obj.read_text()), **fields}
            if "current" in fields:
                d["current"] = {"size": -1, "xxh3": 7}
            obj.write_text(json.dumps(d))
    again = Rig(url, claim=False)
    read = _reading(again)
    assert await again.engine.scan() == len(names)
    if index:  # an index holding such a row is not trusted: every record is read from its object (sound here)
        assert {manifest.record_path(n) for n in names} <= set(read)
        for path in bad:
            await again.engine.load(again.store.inode_at(path).ino)
    else:
        for path in bad:
            with pytest.raises(OSError):
                await again.engine.load(again.store.inode_at(path).ino)
    await again.engine.load(again.store.inode_at("good").ino)
    await again.engine.claim(new_daemon_id(), time.time())
    again.write("mode", b"saved again")
    await run_until_flushed(again)
    assert manifest.read(again.backend, "mode").mode == 0o644


async def test_an_index_that_is_a_symlink_is_not_followed_and_every_record_is_read(tmp_path, caplog):
    """A local store's index replaced by a symlink (to a file of someone
    else's): never followed, and no reason to refuse the mount: the index
    only saves reading the record objects."""
    url = tmp_path / "store"
    rig = await _started(url)
    rig.write("f", b"bytes")
    await run_until_flushed(rig)
    await rig.engine.leave_index()
    elsewhere = tmp_path / "elsewhere"
    (url / INDEX).rename(elsewhere)
    (url / INDEX).symlink_to(elsewhere)
    again = Rig(url, claim=False)
    read = _reading(again)
    assert await again.engine.scan() == 1
    assert manifest.record_path("f") in read
    assert "is no file" in caplog.text
    await again.engine.load(again.store.inode_at("f").ino)


def test_digests_are_equal_by_size_and_hash_whatever_blocks_they_name():
    """A record written before block hashes names none: its digest is the
    same file's as one that names them (as equal, and as a set member)."""
    with_blocks = manifest.Digest(5, "ab" * 16, ("cd" * 16, "ef" * 16))
    without = manifest.Digest(5, "ab" * 16)
    assert with_blocks == without and (with_blocks != without) is False and hash(with_blocks) == hash(without)
    assert {with_blocks} == {without}
    assert with_blocks != manifest.Digest(6, "ab" * 16) and with_blocks != manifest.Digest(5, "00" * 16)
    assert with_blocks != (5, "ab" * 16, ("cd" * 16, "ef" * 16))  # a digest, not any tuple
    rec = manifest.Record("a", "file", with_blocks)
    assert rec == rec._replace(current=without) and rec != rec._replace(mode=0o600)


def test_a_digest_of_before_reads_as_blocks_of_64_mib_and_is_written_back_as_it_was():
    """Digests made now hash blocks of 16 MiB, and their records say so
    under keys a daemon of before does not know (it verifies such a file
    whole rather than against blocks it takes for 64 MiB ones). A record or
    an index row of before (no block size) is of 64 MiB blocks, and a
    digest of 64 MiB blocks, or of one block, is written again as a daemon
    of before wrote it. A block size ckptfs never wrote makes the record
    unreadable."""
    now = manifest.digest_of([b"x" * (manifest.BLOCK + 1)])
    assert now.block_size == manifest.BLOCK == 16 << 20 and len(now.blocks) == 2
    new = json.loads(manifest.Record("a", "file", now).encode())
    assert "blocks" not in new["current"] and new["current"]["block_size"] == manifest.BLOCK
    again = manifest.Record.decode(manifest.Record("a", "file", now).encode()).current
    assert again.blocks == now.blocks and again.block_size == manifest.BLOCK
    assert manifest._of_row(manifest._row(manifest.Record("a", "file", now))).current.block(1, manifest.BLOCK) == now.blocks[1]
    small = manifest.digest_of([b"x" * 1000])  # one block: its record and row are those of before
    assert json.loads(manifest.Record("a", "file", small).encode())["current"] == {"size": 1000, "xxh3": small.xxh3, "blocks": []}
    assert manifest.digest_row(small) == [1000, small.xxh3, []]
    assert manifest.digest_of_row(manifest.digest_row(small)).block(0, manifest.BLOCK) == small.xxh3

    before = {"version": 1, "path": "a", "kind": "file", "mode": 420, "mtime_ns": None, "target": "", "written_ns": 0,
              "source": "", "uid": None, "gid": None, "previous": None,
              "current": {"size": 70 << 20, "xxh3": "ab" * 16, "blocks": ["cd" * 16, "ef" * 16]}}
    rec = manifest.Record.decode(json.dumps(before).encode())
    assert rec.current.block_size == manifest.OLD_BLOCK and rec.current.block(1, manifest.OLD_BLOCK) == "ef" * 16
    assert rec.current.block(1, manifest.BLOCK) is None  # it cannot tell a block of 16 MiB
    assert json.loads(rec.encode()) == before
    row = manifest._row(rec)
    assert row[2] == [70 << 20, "ab" * 16, ["cd" * 16, "ef" * 16]]  # as an index of before holds it
    assert manifest._of_row(manifest._row(rec)) == rec and manifest._of_row(manifest._row(rec)).current.block_size == manifest.OLD_BLOCK
    for bad in (0, 1, 4096, "16777216", 16777216.0, None):
        with pytest.raises(manifest.UNREADABLE):
            manifest.Record.decode(json.dumps({**before, "current": {**new["current"], "block_size": bad}}).encode())


def test_a_digest_holds_the_hash_of_its_files_first_mib_and_one_of_before_reads_without_it():
    """Digests made now hash a file's lead (its first LEAD bytes) too, so
    that a load serves them before the rest of their block: in the record
    under keys of their own (with the lead's size), in the index row and
    event after the block size. A file of LEAD bytes or fewer has none (its
    whole hash is its lead's). Records and rows of before read with none; a
    lead of another size is not checked; one ckptfs never writes makes the
    record unreadable."""
    data = os.urandom(manifest.LEAD) + b"x" * 1000
    now = manifest.digest_of([data[:1000], data[1000:]])  # (pieces across the lead's end)
    assert now.lead == xxhash.xxh3_128(data[: manifest.LEAD]).hexdigest() and not now.blocks
    assert now == now._replace(lead="")  # (equal: size and hash)
    assert manifest.digest_of([data[: manifest.LEAD]]).lead == ""
    big = manifest.digest_of([data * 17])
    assert big.lead == now.lead and len(big.blocks) == 2
    for d in (now, big):
        rec = manifest.Record("a", "file", d)
        current = json.loads(rec.encode())["current"]
        assert (current["lead_size"], current["lead_xxh3"]) == (manifest.LEAD, d.lead)
        assert manifest.Record.decode(rec.encode()).current.lead == d.lead
        assert manifest.digest_row(d)[4:] == [manifest.LEAD, d.lead]
        assert manifest._of_row(manifest._row(rec)).current.lead == d.lead
    without = {"size": now.size, "xxh3": now.xxh3, "blocks": []}
    assert manifest.digest_of_dict(without).lead == "" and manifest.digest_of_row([now.size, now.xxh3, []]).lead == ""
    assert manifest.digest_of_row([now.size, now.xxh3, [], manifest.BLOCK]).lead == ""
    assert manifest.digest_of_dict({**without, "lead_size": 4 << 20, "lead_xxh3": "ab" * 16}).lead == ""  # not checked
    assert manifest.digest_of_row([now.size, now.xxh3, [], manifest.BLOCK, 4 << 20, "ab" * 16]).lead == ""
    for bad in ({"lead_xxh3": "ab" * 16}, {"lead_size": manifest.LEAD}, {"lead_size": "1048576", "lead_xxh3": "ab" * 16},
                {"lead_size": manifest.LEAD, "lead_xxh3": 7}, {"lead_size": manifest.LEAD, "lead_xxh3": ""}):
        with pytest.raises(manifest.UNREADABLE):
            manifest.digest_of_dict({**without, **bad})
    with pytest.raises(manifest.UNREADABLE):  # a lead for a file that is all lead
        manifest.digest_of_dict({"size": 10, "xxh3": "ab" * 16, "blocks": [], "lead_size": manifest.LEAD, "lead_xxh3": "ab" * 16})
    for row in ([1, "ab" * 16, [], manifest.BLOCK, manifest.LEAD], [now.size, now.xxh3, [], manifest.BLOCK, None, "ab" * 16]):
        with pytest.raises(ValueError):
            manifest.digest_of_row(row)


@pytest.mark.parametrize("row", [
    ["a", "file", None, None, 420, None, "", 0, "", None],  # a field short
    ["a", "file", None, None, 420, None, "", 0, "", None, None, None],  # one too many
    ["a", "file", [5, "ab"], None, 420, None, "", 0, "", None, None],  # a digest a field short
    ["a", "file", [5, "ab", [], 1 << 24, 1], None, 420, None, "", 0, "", None, None],
    ["a", "file", [5, "ab", [], 1], None, 420, None, "", 0, "", None, None],
    {"path": "a", "kind": "file"},
    "abcdefghijk",
], ids=["short", "long", "short digest", "long digest", "a block size never written", "an object", "a string"])
def test_an_index_row_of_another_shape_makes_the_index_unreadable(row):
    """A row is decoded by position (`_of_row`): one of another length or
    kind than ckptfs writes is no record, and the index is not trusted (a
    restart reads every record object instead), never a traceback."""
    good = ["b", "file", [1, "cd" * 16, []], None, 420, None, "", 0, "", None, None]
    lines = [b"k1\t" + json.dumps(good).encode(), b"k2\t" + json.dumps(row).encode()]
    assert manifest.Image.of_packed(manifest._pack(1.0, lines)) is None
    assert manifest.Image.of_packed(manifest._pack(1.0, lines[:1])).records()[0]["b"].current == manifest.Digest(1, "cd" * 16)
