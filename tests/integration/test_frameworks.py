"""Real framework saves and loads on a real mount."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.mountutil import drop_caches

torch = pytest.importorskip("torch")


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "weight": torch.randn(512, 1024, generator=g),
        "bias": torch.randn(1024, generator=g),
        "step": torch.tensor(seed),
        "half": torch.randn(333, 77, generator=g).half(),
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_torch_save_load(mnt: Path):
    sd = _state()
    torch.save(sd, mnt / "model.pt")
    drop_caches()
    _assert_same(sd, torch.load(mnt / "model.pt", map_location="cpu"))


def test_torch_load_mmap(mnt: Path):
    sd = _state(1)
    torch.save(sd, mnt / "model.pt")
    drop_caches()
    loaded = torch.load(mnt / "model.pt", mmap=True, map_location="cpu")
    _assert_same(sd, loaded)


def test_torch_from_file_shared(mnt: Path):
    p = mnt / "storage.bin"
    t = torch.arange(1 << 20, dtype=torch.float32)
    p.write_bytes(t.numpy().tobytes())
    drop_caches()
    s = torch.UntypedStorage.from_file(str(p), shared=False, nbytes=t.numel() * 4)
    assert torch.equal(torch.frombuffer(bytearray(bytes(s)), dtype=torch.float32), t)


def test_safetensors_roundtrip(mnt: Path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    sd = {k: v.contiguous() for k, v in _state(2).items()}
    save_file(sd, mnt / "model.safetensors", metadata={"format": "pt"})
    drop_caches()
    _assert_same(sd, load_file(mnt / "model.safetensors"))
    with safe_open(mnt / "model.safetensors", framework="pt") as f:  # mmap, MAP_SHARED
        assert set(f.keys()) == set(sd)
        assert torch.equal(f.get_tensor("weight"), sd["weight"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_save_load(mnt: Path):
    import torch.distributed.checkpoint as dcp

    sd = _state(3)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(mnt / "dcp" / "step-10")))
    names = os.listdir(mnt / "dcp" / "step-10")
    assert ".metadata" in names and not any(n.endswith(".tmp") for n in names)
    drop_caches()
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(mnt / "dcp" / "step-10")))
    _assert_same(sd, target)


def test_temp_file_then_rename(mnt: Path):
    sd = _state(4)
    with tempfile.NamedTemporaryFile(dir=mnt, prefix="tmp", delete=False) as f:
        torch.save(sd, f)
    os.replace(f.name, mnt / "final.pt")
    drop_caches()
    _assert_same(sd, torch.load(mnt / "final.pt"))
    assert os.listdir(mnt) == ["final.pt"]


def test_temp_dir_then_rename(mnt: Path):
    tmp = mnt / "100.orbax-checkpoint-tmp-123"
    tmp.mkdir()
    torch.save(_state(5), tmp / "params.pt")
    (tmp / "commit_success.txt").write_text("ok")
    os.rename(tmp, mnt / "100")
    drop_caches()
    _assert_same(_state(5), torch.load(mnt / "100" / "params.pt"))


def test_rmtree_of_old_checkpoints(mnt: Path):
    for step in range(4):
        d = mnt / f"checkpoint-{step}"
        d.mkdir()
        torch.save(_state(step), d / "model.pt")
        (d / "trainer_state.json").write_text("{}")
        if step >= 2:
            shutil.rmtree(mnt / f"checkpoint-{step - 2}")
    assert sorted(os.listdir(mnt)) == ["checkpoint-2", "checkpoint-3"]
    _assert_same(_state(3), torch.load(mnt / "checkpoint-3" / "model.pt"))


def test_unlinked_while_mmapped_still_readable(mnt: Path):
    sd = _state(6)
    torch.save(sd, mnt / "model.pt")
    loaded = torch.load(mnt / "model.pt", mmap=True)
    os.unlink(mnt / "model.pt")
    drop_caches()
    _assert_same(sd, loaded)


def test_overwrite_in_place_gives_new_content(mnt: Path):
    """A rewritten file must not be served from a stale page cache."""
    for step in range(3):
        torch.save(_state(step), mnt / "latest.pt")
        _assert_same(_state(step), torch.load(mnt / "latest.pt"))
