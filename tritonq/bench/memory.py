"""Peak resident memory while loading, against the bytes the loaded model holds.

    python -m tritonq.bench memory [--layers 6] [--hidden 512] [--json PATH]

Writes one Llama-shaped random checkpoint five ways (dense fp32, dense fp16 loaded as fp32, AWQ,
GPTQ, FP8 per tensor) and loads each in a fresh child process on CPU. The child first loads a tiny
checkpoint of the same format (so every lazy import is done), then reads its resident set (VmRSS)
and loads the big one; its growth is the peak resident set (VmHWM) after the load minus that VmRSS.
(Not resource.getrusage's ru_maxrss: Linux carries it over fork and exec, so a child started by a
big parent reports at least the parent's size.) A row reports it
over `held` (the bytes of every tensor the loaded Model keeps: weights, KV cache and the CPU
backend's prepared weights, each storage once) and `largest` (its largest single tensor).
Target: peak <= 1.3 * held + largest. The child inherits the environment: run from a shell it loads
as a CPU user does (quantized weights also get the CPU backend's prepared form, kernels/cpu/lowbit.py);
under the tests (TRITON_INTERPRET=1) quantized weights are not prepared, so it measures the loader alone.
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

TARGET_FACTOR = 1.3


def write_checkpoints(root: Path, layers: int = 6, hidden: int = 512) -> dict[str, tuple[Path, dict]]:
    """{kind: (folder, tritonq.load options)} for a random Llama of `layers` x `hidden` in five formats."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tritonq.demo import byte_tokenizer
    from tritonq.quantize.writer import write_quantized

    tokenizer = byte_tokenizer()
    config = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    out = {}
    for kind, dtype in (("dense fp32", torch.float32), ("fp16->fp32", torch.float16)):
        folder = root / kind.replace(" ", "_").replace(">", "")
        model.to(dtype).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        out[kind] = (folder, {"dtype": "float32"})
    fp16 = out["fp16->fp32"][0]
    for kind, fmt, options in (("awq", "awq", {"group_size": 128}), ("gptq", "gptq", {"group_size": 128, "sym": True}),
                               ("fp8", "fp8", {"fp8_scheme": "tensor"})):
        out[kind] = (write_quantized(fp16, root / kind, fmt, **options), {"dtype": "float32"})
    return out


def held_bytes(model) -> tuple[int, int]:
    """(bytes of every distinct tensor storage a tritonq Model keeps, bytes of the largest tensor).

    Kept: the modules' tensors, the KV cache, and the CPU backend's prepared form of each typed weight
    (kernels/cpu/lowbit.py keeps it beside the weight for the weight's lifetime: e.g. FP8 dequantized to fp32)."""
    from tritonq.kernels.cpu import lowbit as cpu_lowbit
    seen, largest, stack, visited = {}, 0, [model.model, model.engine.runner.cache], set()
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
            largest = max(largest, obj.nbytes)
        elif id(obj) in visited:
            continue
        elif isinstance(obj, (list, tuple)):
            visited.add(id(obj))
            stack.extend(obj)
        elif isinstance(obj, dict):
            visited.add(id(obj))
            stack.extend(obj.values())
        elif isinstance(obj, torch.nn.Module) or hasattr(obj, "__dataclass_fields__"):
            visited.add(id(obj))
            stack.extend(vars(obj).values())
            prepared = cpu_lowbit._prepared.get(obj) if hasattr(obj, "__dataclass_fields__") else None
            if prepared is not None:
                stack.append(prepared)
    return sum(seen.values()), largest


def _status(field: str) -> int:
    """A /proc/self/status memory figure in bytes: VmRSS (resident now) or VmHWM (peak resident)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def child(folder: str, warmup: str, options: dict) -> dict:
    """Runs in the child: load `warmup`, then measure loading `folder`."""
    import tritonq
    options = {**options, "dtype": getattr(torch, options["dtype"])}  # JSON carries the dtype's name
    tritonq.load(warmup, device="cpu", max_num_seqs=1, max_seq_len=16, **options)
    gc.collect()
    before = _status("VmRSS")
    model = tritonq.load(folder, device="cpu", max_num_seqs=1, max_seq_len=16, **options)
    peak = _status("VmHWM") - before
    held, largest = held_bytes(model)
    file_bytes = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
    return {"file_MiB": file_bytes / 2**20, "held_MiB": held / 2**20, "largest_MiB": largest / 2**20,
            "peak_MiB": peak / 2**20, "peak/held": peak / held,
            "peak/(1.3*held+largest)": peak / (TARGET_FACTOR * held + largest)}


def measure(folder: Path, warmup: Path, options: dict) -> dict:
    """child() in a fresh interpreter (peak RSS is per process); returns its row."""
    code = ("import json, sys; from tritonq.bench.memory import child; "
            "print(json.dumps(child(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))")
    done = subprocess.run([sys.executable, "-c", code, str(folder), str(warmup), json.dumps(options)],
                          capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"the load child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def warmup_for(root: Path, kind: str) -> Path:
    """A tiny checkpoint in the same format as `kind` (written once under root)."""
    from tritonq.demo import write_tiny_llama
    from tritonq.quantize.writer import write_quantized
    dense = root / "warmup"
    if not dense.exists():
        write_tiny_llama(dense, hidden_size=64, num_layers=1)
    formats = {"awq": ("awq", {"group_size": 64}), "gptq": ("gptq", {"group_size": 64, "sym": True}),
               "fp8": ("fp8", {})}
    if kind not in formats:
        return dense
    folder = root / f"warmup_{kind}"
    if not folder.exists():
        write_quantized(dense, folder, formats[kind][0], **formats[kind][1])
    return folder


def run(root: Path, layers: int, hidden: int) -> list[dict]:
    return [{"checkpoint": kind, **measure(folder, warmup_for(root, kind), options)}
            for kind, (folder, options) in write_checkpoints(root, layers, hidden).items()]


def main(argv: list[str] | None = None) -> None:
    from tritonq.bench.common import print_table, write_json
    parser = argparse.ArgumentParser(prog="python -m tritonq.bench memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--json", default=None, help="also write the results here")
    a = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(Path(tmp), a.layers, a.hidden)
    print_table(rows)
    if a.json:
        write_json(a.json, "memory", rows, command=f"python -m tritonq.bench memory {' '.join(argv or [])}")


if __name__ == "__main__":
    main()
