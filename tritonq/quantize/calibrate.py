"""Calibrated int4/int8 quantizers: GPTQ (Hessian-based error feedback) and AWQ (activation-aware scales).

Both need calibration activations. `calibrate(src, method, ...)` feeds calibration text through the
dense model one decoder layer at a time (only that layer's weights are in memory), quantizes the
layer's linears in order, recomputes the layer's outputs with the quantized weights and moves on,
so a model larger than memory is quantized on CPU. The result only changes what the writer stores:
GPTQ returns calibrated `Int4Weight`s (codes, scales, zeros, g_idx), AWQ returns the dense tensors
with its per-channel scales folded in (and optional clipping); `tritonq.quantize.writer.write_quantized`
then writes the usual GPTQModel / AutoAWQ layout.

Shapes: a linear maps K inputs to N outputs, W [N, K] float32, activations X [T, K] (T tokens).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tritonq.quant.packing import group_grid, pack_int32, quantize_column
from tritonq.quant.weights import Int4Weight

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
AWQ_GRID = 20          # scale candidates: s = 1 and 19 alphas in [0, 1]
AWQ_CLIP_GRID = 20     # clip ratios 1, 0.975, ..., 0.525 of each group's max |w|
AWQ_MAX_TOKENS = 4096  # tokens used by the AWQ searches (a random subset when more were captured)


# ---- GPTQ -----------------------------------------------------------------------------------------

def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True,
                  act_order: bool = False, damp: float = 0.01, block_size: int = 128, *, min_zero: int = 0,
                  scale_dtype: torch.dtype = torch.float16) -> Int4Weight:
    """GPTQ-quantize w [N, K] given the Hessian H [K, K] = 2 X^T X / T of its inputs X [T, K].

    Columns are quantized one at a time; each column's rounding error is spread over the columns
    not yet quantized through the inverse Hessian (optimal brain surgeon update), so later columns
    compensate the error the earlier ones made in X W^T. The updates are applied lazily: inside a
    block of block_size columns immediately, to the columns after the block once per block
    (blocks also end at group starts, so a group's grid is fixed on fully updated columns).
    damp * mean(diag H) is added to the diagonal (H may be singular: few tokens, dead inputs).
    act_order: columns are processed by decreasing diag(H) (the most activated inputs first, while
    most columns can still compensate); groups are then runs of group_size columns in that order,
    and g_idx[k] gives input row k's group. A group's scale/zero are set when its first column is
    reached, from the columns as updated so far (as GPTQ does). Returns the Int4Weight (bits 4/8).
    """
    if w.ndim != 2 or hessian.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"gptq_quantize: need w [N, K] and H [K, K], got {list(w.shape)} and {list(hessian.shape)}")
    N, K = w.shape
    g = K if group_size == -1 else group_size
    if g <= 0 or K % g or K % (32 // bits):
        raise ValueError(f"gptq_quantize: K={K} must be a multiple of group_size={group_size} and of {32 // bits}")
    W, H = w.float().clone(), hessian.float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1  # an input never seen: its column is quantized as is, nothing to compensate
    perm = torch.argsort(torch.diag(H), descending=True, stable=True) if act_order else torch.arange(K)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.diag(H).mean() * torch.eye(K)
    # Upper Cholesky factor of H^-1: row j holds the update coefficients of column j over columns > j.
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    G = K // g
    scales, zeros = torch.empty(G, N), torch.empty(G, N)
    codes = torch.empty(N, K)
    start = 0
    while start < K:
        # A block also ends where the next group starts, so that no update is pending when a group's
        # grid is fixed from its columns (with g = block_size = 128 these are GPTQ's usual blocks).
        end = min(start + block_size, K, (start // g + 1) * g)
        errors = torch.empty(N, end - start)
        for j in range(start, end):
            if j % g == 0:  # first column of a group (in processing order): fix its grid now
                scales[j // g], zeros[j // g] = group_grid(W[:, j:j + g], bits, sym, min_zero, scale_dtype)
            s, z = scales[j // g], zeros[j // g]
            codes[:, j] = quantize_column(W[:, j], s, z, bits)
            d = Hinv[j, j]
            err = (W[:, j] - (codes[:, j] - z) * s) / d
            W[:, j + 1:end] -= err[:, None] * Hinv[j, j + 1:end][None, :]
            errors[:, j - start] = err
        W[:, end:] -= errors @ Hinv[start:end, end:]
        start = end
    q = torch.empty_like(codes)
    q[:, perm] = codes
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[perm] = (torch.arange(K) // g).to(torch.int32)
    return Int4Weight(qweight=pack_int32(q.T.to(torch.int32), bits, dim=0), scales=scales.to(scale_dtype),
                      zeros=None if sym else zeros.to(scale_dtype), g_idx=g_idx if act_order else None,
                      group_size=g, bits=bits)


# ---- AWQ --------------------------------------------------------------------------------------------

def rtn_dequantize(w: torch.Tensor, group_size: int, bits: int = 4) -> torch.Tensor:
    """w [N, K] rounded to the asymmetric AWQ grid (quantize_int4's, groups along K) and back, float32."""
    N, K = w.shape
    wg = w.float().reshape(N, K // group_size, group_size)
    scale, zero = group_grid(wg, bits, sym=False)
    return ((quantize_column(wg, scale[..., None], zero[..., None], bits) - zero[..., None]) * scale[..., None]
            ).reshape(N, K)


def awq_loss(gram: torch.Tensor, weights: list[torch.Tensor], scale: torch.Tensor, group_size: int) -> float:
    """sum over W of ||X W^T - X (Q(W diag(s)) diag(s)^-1)^T||^2: output error of the scaled, quantized linears.

    Computed from the Gram matrix gram = X^T X [K, K] (float64) of the inputs X [T, K]: with
    D = W - Q(...), ||X D^T||^2 = sum((D gram) * D), which costs N K^2 instead of T N K per candidate.
    """
    total = 0.0
    for w in weights:
        d = (w - rtn_dequantize(w * scale, group_size) / scale).double()
        total += ((d @ gram) * d).sum().item()
    return total


def awq_weight_mean(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Mean over all output rows of |w| / (its group's max |w|), per input channel [K] (weights [N_i, K]).

    The weight side of AWQ's scale formula: a channel whose weights sit near the top of their
    quantization groups sets the groups' range, so scaling it up costs the other channels precision.
    """
    w = torch.cat([w.float() for w in weights]).abs()
    wg = w.reshape(-1, group_size)
    return (wg / (wg.amax(-1, keepdim=True) + 1e-6)).reshape(w.shape).mean(0)


def awq_search_scale(x: torch.Tensor, weights: list[torch.Tensor], group_size: int,
                     grid: int = AWQ_GRID) -> tuple[torch.Tensor, list[float]]:
    """Per-input-channel scale s [K] for linears sharing the input x [T, K] (weights [N_i, K]).

    `grid` candidates: s = 1 (no scaling) first, then AWQ's scaling
    s = mean|x|^alpha / (awq_weight_mean^(1-alpha) + 1e-4) for grid - 1 alphas evenly over [0, 1],
    each normalised so sqrt(max s * min s) = 1 (scales centred on 1 keep the folded norm and the
    scaled weights in fp16 range). The candidate with the lowest `awq_loss` wins; s = 1 being a
    candidate, the chosen scale never does worse than no scaling on this calibration objective.
    The weight term matters: with activations alone (s = mean|x|^alpha) the search on the default
    model picked scales that raised the held-out perplexity above RTN's (gap closed -0.59); with
    it, 1.42 (bench/results/quality.json). Returns (s, loss of each candidate).
    """
    x_mean, w_mean = x.abs().float().mean(0), awq_weight_mean(weights, group_size)
    candidates = [torch.ones_like(x_mean)]
    for alpha in torch.linspace(0, 1, grid - 1).tolist():
        s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        candidates.append(s / (s.max() * s.min()).sqrt())
    gram = x.double().T @ x.double()
    losses = [awq_loss(gram, weights, s, group_size) for s in candidates]
    return candidates[min(range(len(losses)), key=losses.__getitem__)], losses


def awq_search_clip(x: torch.Tensor, w: torch.Tensor, group_size: int, grid: int = AWQ_CLIP_GRID,
                    max_shrink: float = 0.5) -> torch.Tensor:
    """Per (output row, group) clip value [N, G] minimizing each group's share of the output error.

    For group g the partial output X[:, g] W[:, g]^T is compared with the one of the clipped and
    quantized weights; candidates are amax * (1 - i * max_shrink / grid), i < grid (i = 0: no clip).
    """
    N, K = w.shape
    G = K // group_size
    xg = x.reshape(-1, G, group_size)
    wg = w.reshape(N, G, group_size)
    amax = wg.abs().amax(-1)                                     # [N, G]
    best_err = torch.full((N, G), math.inf)
    best = amax.clone()
    reference = torch.einsum("tgk,ngk->ngt", xg, wg)
    for i in range(grid):
        limit = amax * (1 - i * max_shrink / grid)
        clipped = wg.clamp(-limit[..., None], limit[..., None])
        scale, zero = group_grid(clipped, 4, sym=False)
        deq = (quantize_column(clipped, scale[..., None], zero[..., None], 4) - zero[..., None]) * scale[..., None]
        err = (torch.einsum("tgk,ngk->ngt", xg, deq) - reference).square().sum(-1)
        better = err < best_err
        best_err, best = torch.where(better, err, best_err), torch.where(better, limit, best)
    return best


# ---- layer-by-layer driver ----------------------------------------------------------------------------

@dataclass
class Calibrated:
    """What the writer stores differently: GPTQ's Int4Weights by linear prefix, AWQ's replaced dense tensors."""
    int4: dict[str, Int4Weight] = field(default_factory=dict)
    replaced: dict[str, torch.Tensor] = field(default_factory=dict)


def calibration_ids(src: str | Path, text_file: str | Path, samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """[samples, seq_len] token windows of the text file (tokenized with src's tokenizer) at seeded random offsets."""
    from transformers import AutoTokenizer

    text = Path(text_file).read_text(encoding="utf-8")
    ids = torch.tensor(AutoTokenizer.from_pretrained(src)(text, add_special_tokens=False)["input_ids"])
    if len(ids) < seq_len:
        raise ValueError(f"calibration text {text_file} has {len(ids)} tokens, fewer than --seq-len {seq_len}; "
                         "use a longer text or a shorter --seq-len")
    offsets = torch.randint(0, len(ids) - seq_len + 1, (samples,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([ids[o:o + seq_len] for o in offsets.tolist()])


def _layer_groups(config) -> list[tuple[str | None, list[str]]]:
    """(module whose output feeds the group and that AWQ folds the scale into, linears sharing that input)."""
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return [("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
            # v -> o folding needs one v output per o input: not with grouped-query attention (as AutoAWQ)
            ("self_attn.v_proj" if heads == kv_heads else None, ["self_attn.o_proj"]),
            ("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"]),
            ("mlp.up_proj", ["mlp.down_proj"])]


def _capture_inputs(layer, hidden, position_embeddings, names: list[str]) -> dict[str, torch.Tensor]:
    """Run the layer on hidden [B, L, H] and return the input [B*L, K] of each linear in names."""
    captured, hooks = {}, []
    for name in names:
        module = layer.get_submodule(name)
        hooks.append(module.register_forward_hook(
            lambda m, args, out, name=name: captured.__setitem__(name, args[0].reshape(-1, args[0].shape[-1]))))
    try:
        _forward(layer, hidden, position_embeddings)
    finally:
        for h in hooks:
            h.remove()
    return captured


def _forward(layer, hidden, position_embeddings) -> torch.Tensor:
    with torch.no_grad():
        out = layer(hidden, attention_mask=None, position_embeddings=position_embeddings, use_cache=False)
    return out[0] if isinstance(out, tuple) else out


def calibrate(src: str | Path, method: str, ids: torch.Tensor, *, bits: int = 4, group_size: int = 128,
              sym: bool = True, act_order: bool = False, damp: float = 0.01, block_size: int = 128,
              min_zero: int = 0, clip: bool = False, alpha: float = 0.5, is_converted=lambda prefix: True,
              progress: bool = True) -> Calibrated:
    """Calibrate the dense checkpoint src on token ids [B, L], one decoder layer at a time.

    method "gptq": each linear named by is_converted(prefix) gets a GPTQ Int4Weight (options as
    gptq_quantize). method "awq": per group of linears sharing an input, the activation-aware scale
    is searched, folded into the preceding norm / linear, optional clip values applied; returns the
    changed dense tensors (the writer RTN-quantizes them, which reproduces the searched codes).
    method "smoothquant" (W8A8): per group behind a norm (q|k|v, gate|up), s_j = max|x_j|^alpha /
    max|W[:, j]|^(1 - alpha) is folded into the norm (divided) and the linears (multiplied): the same
    function with activations easier to round to int8; returns the changed dense tensors.
    Within a layer the linears are handled in order (attention inputs, o_proj, gate/up, down_proj)
    with their inputs recomputed after the earlier ones were quantized; the layer's output on the
    quantized weights is the next layer's input.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from tritonq.formats.checkpoint import Weights
    from tritonq.progress import progress_bar

    if method not in ("gptq", "awq", "smoothquant"):
        raise ValueError(f"calibrate: method {method!r} is not supported (supported: gptq, awq, smoothquant)")
    config = AutoConfig.from_pretrained(src)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"calibrated quantization supports model_type {', '.join(SUPPORTED_MODEL_TYPES)}; "
                         f"{src} is {config.model_type!r}: use --method rtn")
    config._attn_implementation = "sdpa"  # causal attention when no mask is passed
    weights = Weights(src)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    rotary = type(skeleton.model.rotary_emb)(config)
    positions = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        hidden = torch.nn.functional.embedding(ids, weights.get_tensor("model.embed_tokens.weight").float())
        position_embeddings = rotary(hidden, positions)
    result = Calibrated()
    for i in progress_bar(total=None, desc=f"{method} calibration", unit="layer", enabled=progress,
                          iterable=range(config.num_hidden_layers)):
        prefix = f"model.layers.{i}"
        layer = skeleton.model.layers[i].to_empty(device="cpu")
        state = {name: weights.get_tensor(f"{prefix}.{name}").float() for name in layer.state_dict()}
        layer.load_state_dict(state)
        groups = []
        for prev, names in _layer_groups(config):
            converted = [n for n in names if is_converted(f"{prefix}.{n}")]
            if converted:  # a scale folded into prev must reach every consumer: none if some stay dense
                groups.append((prev if converted == names else None, converted))
        if method == "gptq":
            for _, names in groups:  # inputs recomputed after the earlier linears were quantized
                inputs = _capture_inputs(layer, hidden, position_embeddings, names[:1])[names[0]]
                hessian = 2 * inputs.T @ inputs / len(inputs)
                for name in names:
                    linear = layer.get_submodule(name)
                    iw = gptq_quantize(linear.weight.data, hessian, bits, group_size, sym, act_order, damp,
                                       block_size, min_zero=min_zero)
                    result.int4[f"{prefix}.{name}"] = iw
                    linear.weight.data = iw.dequantize().float()
        elif method == "smoothquant":
            _smooth_layer(layer, prefix, groups, hidden, position_embeddings, alpha, result)
        else:
            _awq_layer(layer, prefix, groups, hidden, position_embeddings, group_size, clip, result)
        hidden = _forward(layer, hidden, position_embeddings)
        layer.to("meta")  # free this layer's weights
    return result


SMOOTH_MIN = 1e-5  # floor on activation / weight maxima and on the scale (dead channels stay finite)


def _smooth_layer(layer, prefix, groups, hidden, position_embeddings, alpha: float, result: Calibrated) -> None:
    """SmoothQuant one decoder layer in place: for each group whose inputs come out of a norm, fold
    s = max|x|^alpha / max|W|^(1 - alpha) (per input channel) into the norm weight and the linears, and record
    the changed dense tensors. The layer computes the same function, so its output feeds the next layer."""
    norm_groups = [(prev, names) for prev, names in groups
                   if prev is not None and layer.get_submodule(prev).weight.ndim == 1]
    captured = _capture_inputs(layer, hidden, position_embeddings, [names[0] for _, names in norm_groups])
    for prev, names in norm_groups:
        linears = [layer.get_submodule(n) for n in names]
        act_max = captured[names[0]].abs().amax(dim=0).clamp(min=SMOOTH_MIN)
        weight_max = torch.stack([lin.weight.abs().amax(dim=0) for lin in linears]).amax(dim=0).clamp(min=SMOOTH_MIN)
        scale = (act_max.pow(alpha) / weight_max.pow(1 - alpha)).clamp(min=SMOOTH_MIN)
        norm = layer.get_submodule(prev)
        with torch.no_grad():
            norm.weight.div_(scale)
            for lin in linears:
                lin.weight.mul_(scale)
        result.replaced[f"{prefix}.{prev}.weight"] = norm.weight.data.clone()
        for name, lin in zip(names, linears):
            result.replaced[f"{prefix}.{name}.weight"] = lin.weight.data.clone()


def _awq_layer(layer, prefix, groups, hidden, position_embeddings, group_size, clip, result: Calibrated) -> None:
    """AWQ one decoder layer in place (its linears end up dequantized) and record the changed dense tensors.

    The inputs of every group are captured once on the dense layer: folding a scale into the
    preceding module leaves the layer's function unchanged, so later groups see the same inputs.
    All scales are searched and folded first, then each linear is clipped and quantized, so a
    linear that is both a group member and a fold target (up_proj) is quantized once, scaled both ways.
    """
    captured = _capture_inputs(layer, hidden, position_embeddings, [names[0] for _, names in groups])
    gen = torch.Generator().manual_seed(0)
    scaled_inputs = {}
    for prev, names in groups:
        x = captured[names[0]]
        if len(x) > AWQ_MAX_TOKENS:
            x = x[torch.randperm(len(x), generator=gen)[:AWQ_MAX_TOKENS]]
        linears = [layer.get_submodule(n) for n in names]
        if prev is not None:
            scale, _ = awq_search_scale(x, [lin.weight.data for lin in linears], group_size)
            before = layer.get_submodule(prev)
            with torch.no_grad():
                if before.weight.ndim == 1:  # RMSNorm: y = normalized(x) * weight
                    before.weight.div_(scale)
                else:                         # a linear whose output rows are our inputs
                    before.weight.div_(scale[:, None])
                    if getattr(before, "bias", None) is not None:
                        before.bias.div_(scale)
                for lin in linears:
                    lin.weight.mul_(scale)
            x = x / scale
            result.replaced[f"{prefix}.{prev}.weight"] = before.weight.data.clone()
            if getattr(before, "bias", None) is not None:
                result.replaced[f"{prefix}.{prev}.bias"] = before.bias.data.clone()
        for name in names:
            scaled_inputs[name] = x
    for name, x in scaled_inputs.items():
        lin = layer.get_submodule(name)
        w = lin.weight.data
        if clip and not name.endswith(("q_proj", "k_proj")):  # q/k errors are amplified by softmax: not clipped
            limit = awq_search_clip(x, w, group_size).repeat_interleave(group_size, 1)
            w = w.clamp(-limit, limit)
        result.replaced[f"{prefix}.{name}.weight"] = w.clone()
        lin.weight.data = rtn_dequantize(w, group_size)
