"""Tensor parallelism through torch.distributed: this process's rank and the model's collectives.

Launch N processes with `torchrun --nproc-per-node N script.py` (it sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT); `tritonq.load` then joins (or creates) the default process
group: NCCL for CUDA tensors, gloo for CPU ones (tests run 2 CPU ranks this way). Rank r uses
GPU LOCAL_RANK. One process (world 1) never touches torch.distributed: no group, no collectives.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device `tritonq.load` runs on, with an index when it is CUDA. None: cuda when CUDA is available,
    else cpu. A CUDA device without an index is GPU LOCAL_RANK under torchrun (torch's plain "cuda" would be
    GPU 0 on every rank: NCCL then refuses the duplicate GPU) and the current GPU outside it."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda" or device.index is not None:
        return device
    local_rank = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", int(local_rank) if local_rank is not None else torch.cuda.current_device())


def init_tensor_parallel(tensor_parallel: int | None, device: torch.device) -> tuple[int, int]:
    """(rank, world) for loading: tensor_parallel=None follows the launcher (an initialized process
    group, else WORLD_SIZE from torchrun, else 1); 1 stays single-process even under torchrun."""
    if tensor_parallel is not None and tensor_parallel < 1:
        raise ValueError(f"tensor_parallel={tensor_parallel}; expected a positive number of processes")
    if tensor_parallel == 1:
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # env://: torchrun's variables
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    if tensor_parallel is not None and tensor_parallel != world:
        if world == 1:
            raise ValueError(f"tensor_parallel={tensor_parallel} needs {tensor_parallel} processes (one per GPU): "
                             f"launch the script with `torchrun --nproc-per-node {tensor_parallel} script.py`, "
                             "or call torch.distributed.init_process_group in each process before tritonq.load")
        raise ValueError(f"tensor_parallel={tensor_parallel}, but the process group has {world} ranks; pass "
                         f"tensor_parallel={world} (or None to follow the launcher) or launch {tensor_parallel} ranks")
    if world > 1 and device.type == "cuda":
        torch.cuda.set_device(device)
    if rank != 0:  # only rank 0 reports (the once-per-run fallback notes would repeat on every rank)
        logging.getLogger("tritonq").setLevel(logging.ERROR)
    return rank, world


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """x summed over all ranks, in place (row-parallel partial outputs, vocab-parallel embeddings)."""
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] on each rank -> [..., world * n], rank r's part at [r * n, (r + 1) * n) (vocab-parallel logits)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x on every rank, in place (sampled tokens: every rank must feed the same next token)."""
    dist.broadcast(x, src=0)
    return x
