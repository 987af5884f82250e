"""The tensor-parallel split policy of the loaders: which part of a layer each rank reads, and which cuts are refused.

With world > 1 a model asks for a linear with parallel="column" (this rank's N/world outputs, its bias sliced with
them) or parallel="row" (its K/world inputs; the bias on rank 0 only, so the all-reduce adds it once). A loader
(formats/base.py and one file per format) turns the request into a `Shard` (`rank_shard`), refuses a cut through a
pack, a quantization group or an fp8 block naming the layer and the sizes (`check_split`, `check_fp8_split`), and
reads only this rank's slice of each stored tensor (`read_shard`). Row splits of grouped int weights keep the
groups' scales whole when act-order scatters the rows over them (`row_split_cuts_groups`); expert parallelism
places whole experts on each rank (`expert_range`).

A fused output (MPT's Wqkv: all q rows, then all k, then all v) is split as `segments` equal blocks, each cut on its
own: the rank holds its heads of q, then of k, then of v, not one contiguous run of the fused rows. Blocks of
unequal sizes (Qwen3.5's in_proj_qkv: q and k of the key heads, v of more value heads) give segments as a tuple of
their proportions (`block_sizes`), so the same cut works on packed or grouped dims of a quantized weight.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tritonq.formats.checkpoint import Weights, block_sizes

PARALLEL = (None, "column", "row")



@dataclass(frozen=True)
class Shard:
    """The part of one layer this rank holds: part `index` of `count` equal slices of N (parallel "column": outputs)
    or of K ("row": inputs). segments (column only): the N outputs are that many equal fused blocks (or blocks in
    a tuple's proportions, `block_sizes`), each cut into `count` slices; the rank holds slice `index` of every
    block, in block order."""
    parallel: str
    index: int
    count: int
    segments: int | tuple[int, ...] = 1

    def local_shape(self, N: int, K: int) -> tuple[int, int]:
        """(N, K) of this rank's part of an [N, K] linear."""
        return (N // self.count, K) if self.parallel == "column" else (N, K // self.count)

    def take(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part of an in-memory tensor along `dim` (every segment's slice, concatenated), contiguous."""
        pieces, start = [], 0
        for block in block_sizes(tensor.shape[dim], self.segments):
            part = block // self.count
            pieces.append(tensor.narrow(dim, start + self.index * part, part))
            start += block
        return torch.cat(pieces, dim).contiguous()


def rank_shard(parallel: str | None, rank: int, world: int, parts: int | None = None,
               segments: int | tuple[int, ...] = 1) -> Shard | None:
    """Rank `rank` of `world`'s Shard for parallel None / "column" / "row"; None when the layer is read whole.

    parts: how many equal slices the layer may be cut into (default world; e.g. the number of KV heads). With
    parts < world (fewer KV heads than ranks, world a multiple of parts) rank r holds slice r * parts // world, so
    each slice is replicated on world / parts ranks. segments: see Shard (column splits only)."""
    if parallel not in PARALLEL:
        raise ValueError(f"parallel={parallel!r}; expected None, 'column' or 'row'")
    if segments != 1 and parallel != "column":
        raise ValueError(f"segments={segments} with parallel={parallel!r}: only a column split cuts fused blocks")
    if parallel is None or world == 1:
        return None
    parts = parts or world
    if parts >= world:
        return Shard(parallel, rank, world, segments)
    if parallel == "row" or world % parts:
        raise ValueError(f"cannot replicate {parts} {parallel} slices over {world} ranks: "
                         "a column split with world a multiple of parts is needed")
    return Shard(parallel, rank * parts // world, parts, segments)


def split_dim(shard: Shard | None, column: int | None, row: int | None) -> int | None:
    """The dim of a stored tensor that `shard` cuts: `column` for a column shard, `row` for a row shard; None
    (read whole) without a shard or when the tensor has no such dim (e.g. a row shard's per-channel scales)."""
    return None if shard is None else column if shard.parallel == "column" else row


def holds_bias(shard: Shard | None) -> bool:
    """Whether this rank reads the bias: always, except ranks > 0 of a row split (rank 0 adds it once after the
    all-reduce)."""
    return shard is None or shard.parallel == "column" or shard.index == 0


def check_split(prefix: str, shard: Shard, size: int, multiple: int, unit: str) -> None:
    """Refuse a split of `size` (N for column, K for row) into shard.count parts (of each of shard.segments fused
    blocks) that are not whole `unit`s (`multiple` elements each), naming layer `prefix` and the sizes."""
    what = "N (outputs)" if shard.parallel == "column" else "K (inputs)"
    if shard.segments != 1:
        blocks = block_sizes(size, shard.segments)
        if blocks is None or any(block % (shard.count * multiple) for block in blocks):
            if blocks is None:
                sizes, parts = f"fused blocks {shard.segments}", ""
            elif len(set(blocks)) == 1:  # equal blocks: one size each, one part size
                sizes, parts = f"fused blocks of {blocks[0]}", f", of {blocks[0] / shard.count:g}"
            else:
                sizes, parts = f"fused blocks of {blocks}", f", of {[b / shard.count for b in blocks]}"
            raise ValueError(f"{prefix}: cannot split {what}={size} ({sizes}) {shard.parallel}-parallel into "
                             f"{shard.count} parts of each block{parts}: each part must be a multiple of {multiple} "
                             f"({unit}); use a tensor_parallel size that keeps whole packs and groups on each rank")
    elif size % (shard.count * multiple):
        raise ValueError(f"{prefix}: cannot split {what}={size} {shard.parallel}-parallel into {shard.count} parts "
                         f"of {size / shard.count:g}: each part must be a multiple of {multiple} ({unit}); "
                         "use a tensor_parallel size that keeps whole packs and groups on each rank")


def check_fp8_split(prefix: str, shard: Shard | None, N: int, K: int, block_size: tuple[int, int] | None,
                    scale_name: str) -> None:
    """Refuse a split of an fp8 [N, K] weight that cuts a row or column (per-tensor / per-channel scales) or a
    bn x bk scale block (block scales stored in `scale_name`)."""
    if shard is None:
        return
    size = N if shard.parallel == "column" else K
    if block_size is None:
        check_split(prefix, shard, size, 1, "whole rows or columns")
    else:
        bn, bk = block_size
        check_split(prefix, shard, size, bn if shard.parallel == "column" else bk, f"a {bn}x{bk} {scale_name} block")


def read_shard(weights: Weights, name: str, shard: Shard | None, column: int | None, row: int | None,
               dtype: torch.dtype | None = None, shape: tuple | None = None) -> torch.Tensor:
    """Tensor `name` as stored (checked against dtype and the full shape); with a shard, only this rank's slice
    along dim `column` or `row` (by shard.parallel) is read from disk; a None dim reads it whole."""
    dim = split_dim(shard, column, row)
    if dim is None:
        return weights.get_tensor(name, dtype, shape)
    return weights.get_sharded(name, dim, shard.index, shard.count, dtype, shape, segments=shard.segments)


def row_split_cuts_groups(shard: Shard, K: int, group_size: int, g_idx: torch.Tensor | None) -> bool:
    """Whether a row split of a grouped int weight cuts its scales / zeros by group with the rows: true when this
    rank's K / count rows belong to consecutive groups in order (no g_idx, a dry run's meta g_idx, or a g_idx equal
    to k // group_size over these rows). With act-order any row may belong to any group, so every group's scales
    stay on each rank and the rank's slice of g_idx indexes them. g_idx: this rank's slice, or None."""
    if g_idx is None or g_idx.is_meta:
        return True
    part = K // shard.count
    own_groups = torch.arange(shard.index * part, (shard.index + 1) * part) // group_size
    return torch.equal(g_idx.cpu().long(), own_groups)


def expert_range(prefix: str, num_experts: int, rank: int, world: int) -> tuple[int, int]:
    """Expert parallel: (first, count) of the whole experts rank `rank` holds, the same number on each rank."""
    if num_experts % world:
        raise ValueError(f"{prefix}: cannot place n_routed_experts={num_experts} experts on "
                         f"tensor_parallel={world} ranks (expert_parallel=True needs the same number "
                         "on each); use a tensor_parallel that divides it, or expert_parallel=False to "
                         "split every expert by its intermediate size")
    count = num_experts // world
    return rank * count, count
