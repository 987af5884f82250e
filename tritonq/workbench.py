"""What the workbench commands share (bench, tune, check): shape arguments, GEMM shapes of a model
config, result tables. The runtime never imports this module; tritonq/bench/common.py holds what only the
benchmarks share.
"""
from __future__ import annotations


def print_table(rows: list[dict]) -> None:
    """rows (dicts with the same keys) as right-aligned columns under a header line; floats to 3 digits."""
    if not rows:
        return
    cols = list(rows[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).rjust(w) for c, w in zip(cols, widths)))


def model_gemm_shapes(config: dict) -> list[tuple[str, int, int]]:
    """(layer name, N, K) of every distinct linear layer of a decoder block, from a config.json dict.

    Fused projections are listed as the runtime runs them (qkv_proj, gate_up_proj).
    """
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads") if k not in config]
    if missing:
        raise ValueError(f"config.json lacks {missing}: GEMM shapes need hidden_size, intermediate_size "
                         "and num_attention_heads (a Llama- or DeepSeek-V2-style decoder config)")
    D, inter, H = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    shapes = []
    if config.get("kv_lora_rank"):  # DeepSeek-V2 multi-head latent attention
        qk = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        rank, q_rank = config["kv_lora_rank"], config.get("q_lora_rank")
        if q_rank:
            shapes += [("q_a_proj", q_rank, D), ("q_b_proj", H * qk, q_rank)]
        else:
            shapes += [("q_proj", H * qk, D)]
        shapes += [("kv_a_proj_with_mqa", rank + config["qk_rope_head_dim"], D),
                   ("kv_b_proj", H * (config["qk_nope_head_dim"] + config["v_head_dim"]), rank),
                   ("o_proj", D, H * config["v_head_dim"])]
    else:
        head_dim = config.get("head_dim") or D // H
        kv = config.get("num_key_value_heads") or H
        shapes += [("qkv_proj", (H + 2 * kv) * head_dim, D), ("o_proj", D, H * head_dim)]
    shapes += [("gate_up_proj", 2 * inter, D), ("down_proj", D, inter)]
    if config.get("moe_intermediate_size"):
        moe = config["moe_intermediate_size"]
        shapes += [("expert_gate_up", 2 * moe, D), ("expert_down", D, moe)]
    return shapes


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """"16x4096x4096,1x4096x11008" -> [(16, 4096, 4096), (1, 4096, 11008)]."""
    try:
        return [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",") if s]
    except ValueError:
        raise ValueError(f"bad --shapes {text!r}: expected comma-separated MxNxK, e.g. 16x4096x4096") from None
