"""Ranks of one job, each on its own node's mount (cluster mode), saving or
loading one DCP checkpoint: `torchrun ... dcp_ranks.py MODE STEP MOUNT...`.

Rank r uses MOUNT[r]: the same relative path on every node, as a job on
several nodes would. Each rank saves a tensor of its own (its shard); rank
0 writes `.metadata`, after every rank's shard, as DCP does.
MODE: "save" or "load" (checks every rank's values).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

mode, step, mounts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
dist.init_process_group("gloo")
rank = dist.get_rank()
path = os.path.join(mounts[rank], "dcp", f"step-{step}")


def expected() -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {f"rank{rank}.w": torch.randn(512 * 1024, generator=g), f"rank{rank}.step": torch.tensor(step)}


if mode == "save":
    dcp.save(expected(), storage_writer=dcp.FileSystemWriter(path))
else:
    target = {k: torch.zeros_like(v) for k, v in expected().items()}
    dcp.load(target, storage_reader=dcp.FileSystemReader(path))
    for k, v in expected().items():
        assert torch.equal(target[k], v), f"rank {rank}: {k} differs"
dist.barrier()
print(f"rank {rank} {mode}d step {step}", flush=True)
dist.destroy_process_group()
