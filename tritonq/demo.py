"""python -m tritonq.demo (tritonq demo): quantize the shipped default model to AWQ int4, load it and generate.

Needs no download: the default model (tritonq/default_model/checkpoint, ~1M parameters) is a
small Llama trained on Shakespeare's plays (see tritonq/default_model/train.py); the demo
AWQ-calibrates it on the shipped calibration text, writes the int4 checkpoint to --output (kept, and
its path printed), loads it and generates play-like text: a streamed continuation of the prompt, then
a chat reply. write_tiny_llama (a seeded random model with a byte tokenizer) is what the tests use.
"""
from __future__ import annotations

import argparse
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def byte_tokenizer():
    """A PreTrainedTokenizerFast over the 256 byte-level symbols plus <s> (256) and </s> (257)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    vocab.update({"<s>": len(vocab), "</s>": len(vocab) + 1})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_tiny_llama(folder: str | Path, hidden_size: int = 128, num_layers: int = 2, seed: int = 0) -> Path:
    """Save a seeded random LlamaForCausalLM (GQA, tied embeddings) and the byte tokenizer to folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    tokenizer = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Zero embedding rows (tied: also lm_head rows) of non-printable tokens: their logit is then 0, below
    # the top 20 printable ones, so the random model writes printable ASCII instead of broken UTF-8.
    printable = torch.tensor([len(t) == 1 and t.isprintable() and t.isascii()
                              for t in (tokenizer.decode([i]) for i in range(len(tokenizer)))])
    with torch.no_grad():
        model.model.embed_tokens.weight[~printable] = 0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


DEFAULT_MODEL = Path(__file__).parent / "default_model" / "checkpoint"
HELDOUT_TEXT = Path(__file__).parent / "default_model" / "heldout.txt"
CALIBRATION_TEXT = Path(__file__).parent / "default_model" / "calibration.txt"


def build_parser(prog: str = "python -m tritonq.demo") -> argparse.ArgumentParser:
    from tritonq.cli import add_threads_option, new_parser

    parser = new_parser(prog, __doc__.split("\n\n")[0])
    parser.add_argument("--prompt", default="HAMLET:\nTo be, or not to be", help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate for each output")
    parser.add_argument("--output", type=Path, default=Path("tritonq-demo-awq-int4"),
                        help="folder the AWQ int4 checkpoint is written to (kept; overwritten if there)")
    add_threads_option(parser)
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m tritonq.demo") -> None:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens {args.max_new_tokens}: expected 1 or more")
    if args.output.exists() and not args.output.is_dir():
        parser.error(f"--output {args.output} is a file; give a folder for the checkpoint")
    import tritonq
    from tritonq.cli import set_threads
    from tritonq.quantize.writer import write_quantized

    set_threads(args.threads)

    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=0.8, top_k=20, seed=0)
    awq = write_quantized(DEFAULT_MODEL, args.output, "awq", group_size=128, method="awq", overwrite=True,
                          calibration={"file": CALIBRATION_TEXT, "samples": 32, "seq_len": 128}).resolve()
    print(f"wrote the AWQ int4 checkpoint of the default model (1M-parameter Llama trained on Shakespeare) to {awq}")
    model = tritonq.load(awq)
    print(f"loaded it on {model.model.device}; sampling: temperature 0.8, top-k 20, seed 0, "
          f"{args.max_new_tokens} new tokens\n")
    print("prompt:", args.prompt, "", "continuation (streamed):", sep="\n")
    for piece in model.stream(args.prompt, **sampling):
        print(piece, end="", flush=True)
    reply = model.chat([{"role": "user", "content": args.prompt}], return_dict=True, **sampling)
    print("\n\nchat reply (the same prompt as a user message, through the chat template):",
          reply.text[0], f"({reply.decode_tokens_per_s:.0f} decode tokens/s)", sep="\n")
    print(f"\ntry it yourself: tritonq generate {awq} 'ROMEO:' --temperature 0.8")


if __name__ == "__main__":
    main()
