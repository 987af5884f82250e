"""python -m tritonq.bench quality: perplexity and decode tokens/s of each quantization of the default model.

Variants: dense, RTN int4 (AWQ layout, asymmetric, g128 and g32), GPTQ int4 (g128, asymmetric,
gptq_v2), AWQ int4 (g128), GPTQ int8 (g128), FP8 (tensor, channel, block), all written by
`tritonq.quantize` from the shipped default model and loaded with `tritonq.load`. GPTQ and AWQ
calibrate on tritonq/default_model/calibration.txt (Macbeth, training text); perplexity is
measured on heldout.txt (Hamlet, never trained on) in non-overlapping windows of --window tokens
through tritonq's own forward pass. "gap closed" = (ppl(RTN g128) - ppl) / (ppl(RTN g128) - ppl(dense)).
Decode tokens/s: greedy generate of --new-tokens tokens (median of --repeat), on this machine.
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
}


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


def main(argv: list[str]) -> None:
    import tritonq
    from tritonq.demo import CALIBRATION_TEXT, DEFAULT_MODEL, HELDOUT_TEXT
    from tritonq.quantize import write_quantized

    parser = argparse.ArgumentParser(prog="python -m tritonq.bench quality", description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=256, help="tokens per perplexity window")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--samples", type=int, default=64, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per calibration window")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default="bench/results/quality", help="path prefix for .json and .png")
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            fmt, options = VARIANTS[name]
            options = dict(options)
            folder = DEFAULT_MODEL
            if fmt is not None:
                method = options.pop("method", "rtn")
                folder = write_quantized(DEFAULT_MODEL, Path(tmp) / name, fmt, method=method, calibration={
                    "file": CALIBRATION_TEXT, "samples": args.samples, "seq_len": args.seq_len}, **options)
            try:
                # a window scores `window` tokens; the speed run is a short prompt + new_tokens
                model = tritonq.load(folder, device=device, max_num_seqs=1,
                                     max_seq_len=max(args.window, args.new_tokens + 16))
            except ValueError as e:  # e.g. block fp8 needs N multiples of 128; this model's k/v have N = 64
                print(f"{name}: not loadable: {e}")
                rows.append({"variant": name, "perplexity": float("nan"), "decode_tok_s": float("nan"),
                             "error": str(e)})
                continue
            ids = torch.tensor(model.tokenizer(HELDOUT_TEXT.read_text())["input_ids"])
            ppl = window_perplexity(tritonq_logits(model), ids, args.window)
            model.eos_token_ids = set()  # exactly new_tokens tokens each run
            speeds = [model.generate("HAMLET:\n", max_new_tokens=args.new_tokens, return_dict=True).decode_tokens_per_s
                      for _ in range(args.repeat)]
            rows.append({"variant": name, "perplexity": ppl, "decode_tok_s": statistics.median(speeds)})
            print_table(rows[-1:])
    by = {r["variant"]: r["perplexity"] for r in rows}
    rows = [{k: r[k] for k in ("variant", "perplexity", "decode_tok_s")} | r for r in rows]
    if "dense" in by and "rtn_int4_g128" in by:
        gap = by["rtn_int4_g128"] - by["dense"]
        for r in rows:
            r["gap_closed"] = (by["rtn_int4_g128"] - r["perplexity"]) / gap if gap else float("nan")
    print_table(rows)
    write_json(f"{args.out}.json", "quality", rows, backend=backend_label(device), heldout_tokens=len(ids),
               window=args.window, model="tritonq/default_model/checkpoint")
    plot(rows, f"{args.out}.png", f"default model, held-out Hamlet ({len(ids)} tokens), {device}")


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
    b.bar(names, [r["decode_tok_s"] for r in rows], color="tab:orange")
    b.set_ylabel("decode tokens/s")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=60)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")
