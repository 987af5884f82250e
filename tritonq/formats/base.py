"""The loader base: `WeightsLoader` turns the tensors of one checkpoint into the typed weights
(tritonq/quant/weights.py) the model asks for, by Hugging Face module prefix; one subclass per format
(awq.py, gptq.py, fp8.py, compressed_tensors.py, dense.py, ...) reads its quantized layout. Which part
of a layer a tensor-parallel rank reads, and which splits are refused: formats/tensor_parallel.py. The reads
themselves (header checks, the dry run, unread accounting) are formats/reader.py's `CheckpointReader`.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from tritonq.formats.checkpoint import Weights
from tritonq.formats.reader import CheckpointReader
from tritonq.formats.tensor_parallel import Shard, check_split, expert_range, holds_bias, rank_shard
from tritonq.quant.weights import (DenseWeight, Int4Weight, RankExperts, Weight, concat_outputs, empty_linear,
                                   stack_experts)

# Layers that stay dense whatever the format (no packer quantizes them): embeddings (embed_tokens, MPT's wte,
# Falcon's word_embeddings), output head, MoE routers and Qwen2-MoE's [1, D] shared-expert gate (name endings).
# Loaders that quantize on load (formats/dense.py) and the checkpoint writer (tritonq/quantize/writer.py) skip them.
ALWAYS_DENSE = ("embed_tokens", "transformer.wte", "transformer.word_embeddings", "lm_head", "mlp.gate",
                "block_sparse_moe.gate", "mlp.shared_expert_gate")


def always_dense(prefix: str) -> bool:
    return prefix.endswith(ALWAYS_DENSE)


class WeightsLoader(CheckpointReader):
    """Typed weights of one checkpoint format; the model asks for layers by HF prefix.

    A subclass implements `quantized_linear(prefix, shard)` (and `is_quantized(prefix)` if presence of
    its tensors is not enough). Modules named in the ignore list, or stored only as a dense
    `.weight` (e.g. lm_head of an AWQ model), come back as DenseWeight.

    Tensor parallelism: with world > 1 the model asks for parallel="column" (this rank's N/world
    outputs, bias sliced with them) or parallel="row" (its K/world inputs; the bias only on rank 0,
    so the all-reduce adds it once); see formats/tensor_parallel.py. A subclass reads just its slice
    from disk (`read_shard`) and refuses a split through a pack or a group (`check_split`). world == 1
    reads every layer whole.
    """
    marker = ""  # tensor suffix that marks a quantized module, e.g. "qweight"

    def __init__(self, weights: Weights, config: dict, dtype: torch.dtype, device, ignore: list[str] | None = None,
                 *, rank: int = 0, world: int = 1):
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"tensor parallel rank={rank}, world={world}: expected world >= 1 and 0 <= rank < world")
        super().__init__(weights, dtype, device)
        self.config, self.ignore = config, list(ignore or [])
        self.rank, self.world = rank, world

    def is_ignored(self, prefix: str) -> bool:
        # vLLM / AutoAWQ semantics: an entry matches any module whose name contains it.
        return any(entry in prefix for entry in self.ignore)

    def is_quantized(self, prefix: str) -> bool:
        return not self.is_ignored(prefix) and self.weights.has_tensor(f"{prefix}.{self.marker}")

    def stored_shape(self, prefix: str) -> tuple[tuple[int, int], str, tuple[int, ...]]:
        """((N, K), tensor name, its stored shape) of linear `prefix`, from the safetensors header only.

        Quantized loaders override `quantized_shape` for their packed layouts."""
        if self.is_quantized(prefix):
            return self.quantized_shape(prefix)
        name = f"{prefix}.weight"
        stored = self.dense_shape(name)
        return stored, name, stored

    def quantized_shape(self, prefix: str) -> tuple[tuple[int, int], str, tuple[int, ...]]:
        name = f"{prefix}.weight"
        return self.weights.get_shape(name), name, self.weights.get_shape(name)

    def check_shape(self, prefix: str, shape: tuple[int, int] | None) -> None:
        """Refuse linear `prefix` when its stored (N, K) is not `shape` (the model's, from config.json),
        before any data is read."""
        if shape is None:
            return
        (N, K), name, stored = self.stored_shape(prefix)
        if (N, K) != tuple(shape):
            implied = "" if (N, K) == stored else f" (a linear of [N={N}, K={K}])"
            raise ValueError(f"{self.weights.folder}: tensor {name!r} has shape {list(stored)}{implied}, but config.json "
                             f"implies [N={shape[0]}, K={shape[1]}] for {prefix}; the config does not match the "
                             "weights: fix config.json or load the checkpoint it belongs to")

    def get_linear(self, prefix: str, bias: bool = False, parallel: str | None = None,
                   parts: int | None = None, shape: tuple[int, int] | None = None,
                   segments: int | tuple[int, ...] = 1) -> Weight:
        """The linear `prefix` (see the class docstring for parallel, tensor_parallel.rank_shard for parts and
        segments: a fused output of that many blocks, each split on its own).

        shape: the full (N, K) the model expects, checked against the header before reading."""
        self.check_shape(prefix, shape)
        shard = self.shard(parallel, parts, segments)
        if self.is_quantized(prefix):
            w = self.quantized_linear(prefix, shard)
            row = shard is not None and shard.parallel == "row"
            if row and isinstance(w, Int4Weight) and w.shape[1] % w.group_size:
                # act-order keeps every group's scales on each row shard, but the int4 kernels still need
                # whole groups of rows on each rank (K % group_size == 0).
                check_split(prefix, shard, w.shape[1] * shard.count, w.group_size,
                            f"a quantization group of {w.group_size} input rows, act-order included")
        else:
            w = DenseWeight(self._dense_matrix([prefix], [shard])[0])
        if bias:
            w = replace(w, bias=self._bias(prefix, shard, w.shape[0]))
        return w

    def shard(self, parallel: str | None, parts: int | None = None,
              segments: int | tuple[int, ...] = 1) -> Shard | None:
        """This rank's Shard of a layer (tensor_parallel.rank_shard); None when it is read whole."""
        return rank_shard(parallel, self.rank, self.world, parts, segments)

    def _bias(self, prefix: str, shard: Shard | None, local_N: int) -> torch.Tensor | None:
        """Bias [local_N] of linear `prefix` (this rank's outputs), or None on ranks > 0 of a row split."""
        N = local_N if shard is None or shard.parallel == "row" else local_N * shard.count
        if holds_bias(shard):
            return self._read_float(f"{prefix}.bias", shard, column=0, row=None, shape=(N,))
        if self.has_tensor(f"{prefix}.bias"):
            self.weights.mark_read(f"{prefix}.bias")  # rank 0 adds it once after the all-reduce
        return None

    def _dense_matrix(self, prefixes: list[str], shards: list[Shard | None]) -> tuple[torch.Tensor, list[int]]:
        """(W [N, K], each part's N): dense linears `prefixes` (each this rank's slice by its shard) fused along
        N into one matrix in the compute dtype and `empty_linear`'s layout, each read straight into its rows:
        no per-part copy, no concatenation, no re-layout later (peak = the fused weight plus a read buffer)."""
        parts = []
        for prefix, shard in zip(prefixes, shards):
            name = f"{prefix}.weight"
            N, K = self.dense_shape(name)
            if shard is not None:
                check_split(prefix, shard, N if shard.parallel == "column" else K, 1, "whole rows or columns")
                N, K = shard.local_shape(N, K)
            self.check_float(name)
            parts.append((name, shard, N, K))
        if len({K for *_, K in parts}) != 1:
            raise ValueError(f"{self.weights.folder}: cannot fuse linears {prefixes} with different input sizes K "
                             f"{[K for *_, K in parts]}; the checkpoint's shapes do not fit this model")
        out = empty_linear(sum(N for _, _, N, _ in parts), parts[0][3], self.dtype, self.device)
        first = 0
        for name, shard, N, _ in parts:
            self._read_float(name, shard, column=0, row=1, out=out[first:first + N])
            first += N
        return out, [N for _, _, N, _ in parts]

    def get_fused_linear(self, prefixes: list[str], bias: bool = False, parallel: str | None = None,
                         parts: list[int | None] | None = None,
                         shapes: list[tuple[int, int] | None] | None = None,
                         segments: list[int | tuple[int, ...]] | None = None) -> Weight:
        """Linears sharing their input, fused along N; each is sharded on its own (q, k, v: each rank
        gets its heads of each), parts, expected (N, K) shapes and segments (get_linear's) per prefix. Dense
        ones are read straight into the fused matrix (`_dense_matrix`); quantized ones are concatenated."""
        parts = parts or [None] * len(prefixes)
        shapes = shapes or [None] * len(prefixes)
        segments = segments or [1] * len(prefixes)
        if any(self.is_quantized(p) for p in prefixes):
            return concat_outputs([self.get_linear(p, bias, parallel, n, s, b)
                                   for p, n, s, b in zip(prefixes, parts, shapes, segments)])
        for prefix, shape in zip(prefixes, shapes):
            self.check_shape(prefix, shape)
        shards = [self.shard(parallel, n, b) for n, b in zip(parts, segments)]
        weight, sizes = self._dense_matrix(prefixes, shards)
        biases = [self._bias(p, s, n) for p, s, n in zip(prefixes, shards, sizes)] if bias else [None]
        return DenseWeight(weight, None if biases[0] is None else torch.cat(biases))

    def get_stacked(self, prefixes: list[str], shape: tuple[int, int] | None = None,
                    parallel: str | None = None) -> Weight:
        """Expert linears stacked along a leading E, each this rank's slice by `parallel` (as get_linear).
        Dense experts are read straight into one contiguous [E, N, K] tensor (the MoE kernels' layout);
        quantized ones are stacked."""
        if any(self.is_quantized(p) for p in prefixes):
            return stack_experts([self.get_linear(p, parallel=parallel, shape=shape) for p in prefixes])
        shapes = {p: self.stored_shape(p)[0] for p in prefixes}
        if len(set(shapes.values())) != 1:
            raise ValueError(f"{self.weights.folder}: experts of one MoE layer must have one shape; found {shapes}")
        shard = self.shard(parallel)
        N, K = shapes[prefixes[0]]
        for prefix in prefixes:
            self.check_shape(prefix, shape)
            self.check_float(f"{prefix}.weight")
            if shard is not None:
                check_split(prefix, shard, N if shard.parallel == "column" else K, 1, "whole rows or columns")
        if shard is not None:
            N, K = shard.local_shape(N, K)
        out = torch.empty(len(prefixes), N, K, dtype=self.dtype, device=self.device)
        for e, prefix in enumerate(prefixes):
            self._read_float(f"{prefix}.weight", shard, column=0, row=1, out=out[e])
        return DenseWeight(out)

    def get_fused_experts(self, name: str, shape: tuple[int, int, int], interleaved: bool = False,
                          parallel: str | None = None) -> Weight:
        """Experts stored fused in one module as transformers' gpt-oss does, as a stacked typed weight
        [E, N, K] with its bias [E, N] (`{name}_bias`).

        Dense: `{name}` [E, K, N] (x @ W per expert, transformers' layout), transposed once to [E, N, K].
        Quantized formats override `quantized_experts` (mxfp4: `{name}_blocks` / `_scales`).
        interleaved: output rows alternate gate, up (gpt-oss's gate_up_proj); they come back as all gate
        rows then all up rows, the order fused_moe's gate/up GEMM reads.
        parallel: "column" reads this rank's N/world outputs of every expert (interleaved: whole gate/up
        pairs, so its gate rows and up rows are the same intermediate slice), "row" its K/world inputs
        (the bias on rank 0 only: the all-reduce adds it once)."""
        E, N, K = shape
        shard = self.shard(parallel)
        if shard is not None:
            check_split(name, shard, N if shard.parallel == "column" else K, 2 if interleaved else 1,
                        "a gate/up pair" if interleaved else "whole rows or columns")
        if self.is_quantized(name):
            w = self.quantized_experts(name, shape, shard)
        else:
            self._check_tensor_shape(name, (E, K, N))
            w = DenseWeight(self._read_float(name, shard, column=2, row=1).transpose(1, 2).contiguous())
        bias = self._expert_bias(f"{name}_bias", shard, (E, N))
        if interleaved:
            local_N = N // shard.count if shard is not None and shard.parallel == "column" else N
            order = torch.cat([torch.arange(0, local_N, 2), torch.arange(1, local_N, 2)])
            w = w.take_outputs(order)
            bias = bias[:, order.to(bias.device)]
        return replace(w, bias=None if bias is None else bias.contiguous())

    def _expert_bias(self, name: str, shard: Shard | None, shape: tuple[int, int]) -> torch.Tensor | None:
        """Expert biases [E, N] (this rank's N slice), or None on ranks > 0 of a row split."""
        if holds_bias(shard):
            return self._read_float(name, shard, column=1, row=None, shape=shape)
        self._check_tensor_shape(name, shape)
        self.weights.mark_read(name)  # rank 0 adds it once after the all-reduce
        return None

    def quantized_experts(self, name: str, shape: tuple[int, int, int], shard: Shard | None) -> Weight:
        raise NotImplementedError
    def get_experts(self, prefix: str, num_experts: int, hidden: int, inter: int, expert_parallel: bool = False,
                    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> RankExperts:
        """This rank's routed experts `prefix.experts.{e}.{gate,up,down}_proj` of one MoE layer, stacked for
        fused_moe (RankExperts: E' experts from global expert `first`, intermediate size I'). names: the
        (gate, up, down) module names inside one expert (Mixtral: w1, w3, w2).

        world 1: all E experts whole. Tensor parallel: all E experts, each split by its intermediate size
        (gate/up column-parallel, down row-parallel: I' = I / world; a split through a pack, group or fp8
        block is refused naming the expert). expert_parallel: experts [rank * E/world, (rank + 1) * E/world)
        whole; the other ranks' expert tensors are counted as read (their ranks read them)."""
        experts = [f"{prefix}.experts.{e}" for e in range(num_experts)]
        first, parallel = 0, "column"
        if expert_parallel and self.world > 1:
            first, count = expert_range(prefix, num_experts, self.rank, self.world)
            parallel = None
            mine = experts[first:first + count]
            others = tuple(f"{p}." for p in experts if p not in mine)
            for name in self.weights.names():
                if name.startswith(others):
                    self.weights.mark_read(name)
            experts = mine
        gate, up, down = names
        gate_up = stack_experts([self.get_fused_linear([f"{p}.{gate}", f"{p}.{up}"], parallel=parallel,
                                                       shapes=[(inter, hidden), (inter, hidden)]) for p in experts])
        down = self.get_stacked([f"{p}.{down}" for p in experts], shape=(hidden, inter),
                                parallel=None if parallel is None else "row")
        return RankExperts(gate_up, down, first, num_experts)

    def get_tensor(self, name: str, dim: int | None = None, shape: tuple | None = None,
                   layout: str = "contiguous") -> torch.Tensor:
        """A float tensor in the compute dtype on the device; with dim, this rank's 1/world slice along it
        (vocab-parallel embedding rows). shape: the full stored shape expected (checked before reading).
        layout="linear": a 2-D tensor in `empty_linear`'s layout (a table a tied lm_head also multiplies)."""
        if shape is not None and self.has_tensor(name):
            self._check_tensor_shape(name, shape)
        shard = None if dim is None else self.shard("column")
        out = None
        if layout == "linear" and self.has_tensor(name) and len(self.weights.get_shape(name)) == 2:
            N, K = self.weights.get_shape(name)
            if shard is not None:  # vocab rows (dim 0) or columns (dim 1) of this rank
                N, K = (N // shard.count, K) if dim == 0 else (N, K // shard.count)
            out = empty_linear(N, K, self.dtype, self.device)
        return self._read_float(name, shard, column=dim, row=None, out=out)

    def get_embedding(self, prefix: str, shape: tuple[int, int] | None = None, dim: int | None = None) -> torch.Tensor:
        """The embedding table [V, D] of module `prefix` in the compute dtype (with dim=0, this rank's
        V/world rows). A quantized table (GPTQ/AWQ/fp8/compressed-tensors can carry one) is read as the
        same typed weight a linear would be and dequantized exactly once here: a lookup needs the rows.
        A dense table that config.json ties to the output head is read in the head's layout (`empty_linear`),
        so the head's Linear uses it as it is, without a copy (the lookup reads either layout)."""
        if not self.is_quantized(prefix):
            tied = bool(self.config.get("tie_word_embeddings")) and not self.is_quantized("lm_head")
            return self.get_tensor(f"{prefix}.weight", dim=dim, shape=shape, layout="linear" if tied else "contiguous")
        self.check_shape(prefix, shape)
        if dim is not None and self.world > 1:
            raise ValueError(f"{prefix} is stored quantized; a quantized embedding cannot be split by vocabulary "
                             f"rows over tensor_parallel={self.world} yet: load with tensor_parallel=1")
        return self.quantized_linear(prefix).dequantize().to(device=self.device, dtype=self.dtype)

    def get_lm_head(self, tied: bool, shape: tuple[int, int] | None = None, parallel: str | None = None,
                    prefix: str = "lm_head") -> Weight | None:
        """The output head, or None when the model must reuse its embedding table (tied).

        A quantized head on disk is always used (GPTQModel `lm_head: true` / `dynamic`, or any format
        that stores it quantized), tied or not; a dense `lm_head.weight` is used when untied and, when
        tied, counted as a redundant copy (transformers ties it too). Untied with no head on disk is an
        error: reusing the embedding would be a different model."""
        if self.is_quantized(prefix) or (not tied and self.has_tensor(f"{prefix}.weight")):
            return self.get_linear(prefix, parallel=parallel, shape=shape)
        if tied:
            if self.has_tensor(f"{prefix}.weight"):
                self.weights.mark_read(f"{prefix}.weight")
            return None
        stored = sorted(n for n in self.weights.names() if n.startswith(prefix + "."))
        raise ValueError(f"{self.weights.folder}: config.json has tie_word_embeddings=false but the checkpoint has no "
                         f"{prefix}.weight" + (f" (found {stored}, which is no format this loader reads)" if stored
                                               else "") + "; add the output head to the checkpoint, or set "
                         "tie_word_embeddings=true if the model really reuses its embedding")

    def quantized_linear(self, prefix: str, shard: Shard | None = None) -> Weight:
        raise NotImplementedError
