"""python -m tritonq.bench quality: perplexity and decode tokens/s of each quantization of the default model.

Variants: dense, RTN int4 (AWQ layout, asymmetric, g128 and g32), GPTQ int4 (g128, asymmetric,
gptq_v2), AWQ int4 (g128), GPTQ int8 (g128), FP8 (tensor, channel, block), W8A8 INT8 (per-channel weights,
dynamic per-token activations; plain RTN and with SmoothQuant alpha 0.5), all written by
`tritonq.quantize` from the shipped default model and loaded with `tritonq.load`. GPTQ and AWQ
calibrate on tritonq/default_model/calibration.txt (Macbeth, training text); perplexity is
measured on heldout.txt (Hamlet, never trained on) in non-overlapping windows of --window tokens
through tritonq's own forward pass. "gap closed" = (ppl(RTN g128) - ppl) / (ppl(RTN g128) - ppl(dense)).
Decode tokens/s: greedy generate of --new-tokens tokens (median of --repeat), on this machine.
FP8 block (128x128): a fused group (q|k|v, gate|up) with an N below/not a multiple of 128 cannot be
written (the default model's k/v have N = 64), so that group stays dense and the row's note says so;
a variant that cannot be written or loaded at all keeps its row with NaNs and the reason.
KV-cache rows (dense_kv_fp8, dense_kv_int8): the dense weights loaded with kv_cache_dtype fp8 / int8, so every
window's attention reads 8-bit K/V; the note gives the perplexity change against the dense row. Every row has
kv_tokens_per_gib: the tokens one GiB of its KV cache holds (per-token bytes of all layers, scales included).
"""
from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from pathlib import Path

import torch

from tritonq.bench.common import backend_label, print_table, write_json

VARIANTS = {  # name: (format, writer options)
    "dense": (None, {}),
    "rtn_int4_g128": ("awq", {"group_size": 128}),
    "rtn_int4_g32": ("awq", {"group_size": 32}),
    "gptq_int4_g128": ("gptq", {"group_size": 128, "sym": False, "checkpoint_format": "gptq_v2", "method": "gptq"}),
    "awq_int4_g128": ("awq", {"group_size": 128, "method": "awq"}),
    "gptq_int8_g128": ("gptq", {"group_size": 128, "bits": 8, "sym": True, "method": "gptq"}),
    "fp8_tensor": ("fp8", {"fp8_scheme": "tensor"}),
    "fp8_channel": ("fp8", {"fp8_scheme": "channel"}),
    "fp8_block": ("fp8", {"fp8_scheme": "block"}),
    "w8a8_channel": ("w8a8", {"w8a8_scheme": "channel"}),
    "w8a8_smooth0.5": ("w8a8", {"w8a8_scheme": "channel", "smooth": 0.5}),
}
KV_CACHE_VARIANTS = {"dense_kv_fp8": "fp8", "dense_kv_int8": "int8"}  # name: kv_cache_dtype (dense weights)


def window_perplexity(logits_fn, ids: torch.Tensor, window: int) -> float:
    """exp(mean NLL) of ids [T] scored in non-overlapping windows; logits_fn([1, L] ids) -> [1, L, V] logits."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1]
        if len(chunk) < 2:
            break
        logits = logits_fn(chunk[None, :-1]).float()
        total += torch.nn.functional.cross_entropy(logits[0], chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(total / count)


def tritonq_logits(model):
    """Prefill logits [1, L, V] of the loaded tritonq model for ids [1, L] (one sequence, from position 0),
    through the engine's paged cache."""
    def logits(ids):
        return model.engine.prompt_logits(ids[0].tolist())[None].cpu()
    return logits


def model_perplexity(model, text: str, window: int, max_tokens: int | None = None) -> tuple[float, int]:
    """(perplexity, tokens scored) of the loaded tritonq model on text: the first max_tokens tokens
    (all when None) in non-overlapping windows of `window` tokens. The one place the bench scores text."""
    ids = torch.tensor(model.tokenizer(text)["input_ids"][:max_tokens])
    return window_perplexity(tritonq_logits(model), ids, window), len(ids)


def block_fp8_dense_modules(src: Path, block: int = 128) -> list[str]:
    """Linears to keep dense so block-fp8 can be written: every member of a fused group (q|k|v, gate|up)
    with some member whose N is not a multiple of `block` (the writer refuses such a group)."""
    import json

    config = json.loads((src / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or config["num_attention_heads"]
    groups = {("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
              (config["num_attention_heads"] * head_dim, kv * head_dim, kv * head_dim),
              ("mlp.gate_proj", "mlp.up_proj"): (config["intermediate_size"],) * 2}
    return [name for names, ns in groups.items() if any(n % block for n in ns) for name in names]


def variant_checkpoint(name: str, tmp: Path, calibration: dict) -> tuple[Path, str]:
    """Write variant `name` of the default model under tmp; returns (folder, note for the table)."""
    from tritonq.demo import DEFAULT_MODEL
    from tritonq.quantize.writer import write_quantized

    fmt, options = VARIANTS.get(name, (None, {}))  # KV_CACHE_VARIANTS: the dense weights
    options, note = dict(options), ""
    if fmt is None:
        return DEFAULT_MODEL, note
    if options.get("fp8_scheme") == "block":
        dense = block_fp8_dense_modules(DEFAULT_MODEL)
        if dense:  # this model's k/v projections have N = 64 < 128: say so rather than drop the row
            options["modules_to_not_convert"] = dense
            note = f"N < 128-row block: {', '.join(n.split('.')[-1] for n in dense)} kept dense"
    method = options.pop("method", "rtn")
    if "smooth" in options:  # SmoothQuant folding reads the calibration text's activations
        calibration = {**calibration, "smooth": options.pop("smooth")}
    return write_quantized(DEFAULT_MODEL, tmp / name, fmt, method=method, calibration=calibration, **options), note


def quality_rows(variants: list[str], *, window: int = 256, new_tokens: int = 32, repeat: int = 3, samples: int = 64,
                 seq_len: int = 128, max_tokens: int | None = None, device: str | None = None,
                 verbose: bool = True) -> tuple[list[dict], int]:
    """The table: one row per variant {variant, perplexity, decode_tok_s, gap_closed, kv_tokens_per_gib, note} and
    the number of held-out tokens scored. A variant that cannot be written or loaded keeps its row, with NaNs and the
    error."""
    import tritonq
    from tritonq.demo import CALIBRATION_TEXT, HELDOUT_TEXT

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    calibration = {"file": CALIBRATION_TEXT, "samples": samples, "seq_len": seq_len}
    rows, scored = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in variants:
            note = ""
            try:
                folder, note = variant_checkpoint(name, Path(tmp), calibration)
                # a window scores `window` tokens; the speed run is a short prompt + new_tokens
                model = tritonq.load(folder, device=device, max_num_seqs=1, max_seq_len=max(window, new_tokens + 16),
                                     kv_cache_dtype=KV_CACHE_VARIANTS.get(name, "auto"))
            except ValueError as e:  # a format this model cannot take: the row says why
                rows.append({"variant": name, "perplexity": float("nan"), "decode_tok_s": float("nan"),
                             "kv_tokens_per_gib": float("nan"), "note": f"not available: {e}"})
                if verbose:
                    print(f"{name}: not available: {e}")
                continue
            ppl, scored = model_perplexity(model, HELDOUT_TEXT.read_text(), window, max_tokens)
            model.eos_token_ids = set()  # exactly new_tokens tokens each run
            speeds = [model.generate("HAMLET:\n", max_new_tokens=new_tokens, return_dict=True).decode_tokens_per_s
                      for _ in range(repeat)]
            per_gib = 2 ** 30 // model.model.kv_layout.bytes_per_token(model.model.dtype)
            rows.append({"variant": name, "perplexity": ppl, "decode_tok_s": statistics.median(speeds),
                         "kv_tokens_per_gib": per_gib, "note": note})
            if verbose:
                print_table(rows[-1:])
    by = {r["variant"]: r["perplexity"] for r in rows}
    rtn = by.get("rtn_int4_g128", float("nan"))
    gap = rtn - by.get("dense", float("nan"))  # NaN unless both rows were measured
    dense = by.get("dense", float("nan"))
    for r in rows:  # the KV rows' cost: their perplexity change against the same weights with a model-dtype cache
        if r["variant"] in KV_CACHE_VARIANTS and math.isfinite(dense) and math.isfinite(r["perplexity"]):
            r["note"] = (f"ppl {r['perplexity'] - dense:+.4f} vs dense; KV cache holds {r['kv_tokens_per_gib']:,} "
                         f"tokens/GiB (dense: {next(d['kv_tokens_per_gib'] for d in rows if d['variant'] == 'dense'):,})")
    rows = [{"variant": r["variant"], "perplexity": r["perplexity"], "decode_tok_s": r["decode_tok_s"],
             "gap_closed": (rtn - r["perplexity"]) / gap if math.isfinite(gap) and gap else float("nan"),
             "kv_tokens_per_gib": r["kv_tokens_per_gib"], "note": r["note"]} for r in rows]
    return rows, scored


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tritonq.bench quality", description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=256, help="tokens per perplexity window")
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the first N held-out tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--samples", type=int, default=64, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per calibration window")
    parser.add_argument("--variants", nargs="*", default=[*VARIANTS, *KV_CACHE_VARIANTS],
                        choices=[*VARIANTS, *KV_CACHE_VARIANTS])
    parser.add_argument("--out", default="bench/results/quality", help="path prefix for .json and .png")
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, scored = quality_rows(args.variants, window=args.window, new_tokens=args.new_tokens, repeat=args.repeat,
                                samples=args.samples, seq_len=args.seq_len, max_tokens=args.max_tokens, device=device)
    print_table(rows)
    write_json(f"{args.out}.json", "quality", rows, backend=backend_label(device), heldout_tokens=scored,
               window=args.window, calibration={"samples": args.samples, "seq_len": args.seq_len},
               model="tritonq/default_model/checkpoint")
    plot(rows, f"{args.out}.png", f"default model, held-out Hamlet ({scored} tokens), {device}")


def markdown_table(rows: list[dict], speed: bool = True) -> str:
    """The rows as a Markdown table (docs/benchmarks.md, notebooks): perplexity to 3 decimals (the int4 gaps are small);
    speed=False leaves out decode tokens/s (a stored run's speed says little about this machine's)."""
    def fmt(v, spec):
        return "n/a" if not math.isfinite(v) else format(v, spec)

    speed_head, speed_rule = ("decode tok/s | ", "---:|") if speed else ("", "")
    lines = [f"| variant | perplexity | gap closed | {speed_head}note |", f"|---|---:|---:|{speed_rule}---|"]
    lines += [f"| {r['variant']} | {fmt(r['perplexity'], '.3f')} | {fmt(r['gap_closed'], '.2f')} | "
              + (f"{fmt(r['decode_tok_s'], '.1f')} | " if speed else "") + f"{r['note']} |" for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["variant"] for r in rows]
    ppl = [r["perplexity"] for r in rows]
    a.bar(names, ppl, color="tab:blue")
    a.set_ylabel("perplexity (lower is better)")
    finite = [p for p in ppl if math.isfinite(p)]
    a.set_ylim(min(finite) * 0.95, max(finite) * 1.02)
    for i, r in enumerate(rows):  # a row this model cannot take stays on the chart, marked
        if not math.isfinite(r["perplexity"]):
            a.text(i, min(finite) * 0.96, "n/a", ha="center", rotation=90)
    b.bar(names, [r["decode_tok_s"] for r in rows], color="tab:orange")
    b.set_ylabel("decode tokens/s")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=60)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")
