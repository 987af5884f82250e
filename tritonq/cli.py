"""The `tritonq` command (also `python -m tritonq`): one entry point with a subcommand per job, as vLLM's.

    tritonq generate MODEL "prompt"     stream one completion to stdout
    tritonq chat MODEL                  an interactive chat (one line a turn; Ctrl-D ends)
    tritonq serve MODEL                 the OpenAI-compatible server      (python -m tritonq.serve)
    tritonq quantize SRC DST --format   write an AWQ / GPTQ / FP8 / MXFP4 / W8A8 checkpoint (python -m tritonq.quantize)
    tritonq eval perplexity|lm_eval     perplexity or lm-evaluation-harness tasks (python -m tritonq.eval)
    tritonq bench NAME                  a benchmark                        (python -m tritonq.bench)
    tritonq tune --kernel K             sweep a kernel's launch configs    (python -m tritonq.tune)
    tritonq check                       the kernel tests, one line each    (python -m tritonq.check)
    tritonq demo                        quantize the shipped model and generate (python -m tritonq.demo)

Each subcommand runs the same main as its `python -m` form. Every parser is built before torch is
imported (the import takes seconds), so `--help` and argument errors answer at once; a bad argument, a
checkpoint that cannot be loaded or a missing optional dependency ends with one `error:` line and exit
status 2, never a traceback. This module holds the options shared by the commands that load a model,
and the generate / chat / quantize commands.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import sys
import time

from tritonq.config import EngineConfig  # torch-free: the parsers are built before torch loads
DTYPE_NAMES = ("auto", "float32", "float16", "bfloat16")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions as written and shows each option's default, unless it has none (None / a flag off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        no_default = action.default == "" or any(action.default is none for none in (None, False, argparse.SUPPRESS))
        if "%(default)" in text or no_default or not action.option_strings:  # `is`: 0 == False, yet 0 is a default
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse's parser with one line for a bad argument (no usage block above it): `PROG: error: WHAT`."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def new_parser(prog: str, description: str, **kwargs) -> argparse.ArgumentParser:
    """A Parser with tritonq's help format (defaults shown)."""
    return Parser(prog=prog, description=description, formatter_class=HelpFormatter, **kwargs)


def fail(parser: argparse.ArgumentParser, message: object) -> None:
    """End with one line `PROG: error: MESSAGE` and exit status 2 (argparse's, without its usage lines)."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def require(parser: argparse.ArgumentParser, modules: tuple[str, ...], extra: str) -> None:
    """fail() naming the optional dependencies that are not installed and the extra that installs them."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        fail(parser, f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed; "
                     f"pip install 'tritonq[{extra}]'")


def add_threads_option(parser) -> None:
    """--threads: this process's CPU threads (torch's OpenMP team, which the C kernels run on too)."""
    parser.add_argument("--threads", type=_thread_count, default=None,
                        help="CPU threads for torch and the C kernels (default: torch's, one per physical core; on "
                             "cores other jobs share fewer can be faster: docs/cli_behaviour.md)")


def _thread_count(text: str) -> int:
    try:
        threads = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if threads < 1:
        raise argparse.ArgumentTypeError(f"{threads}; expected 1 or more threads")
    return threads


def set_threads(threads: int | None) -> None:
    """torch.set_num_threads(threads) unless None (commands that do not load a model; load() takes threads=)."""
    if threads is not None:
        import torch
        torch.set_num_threads(threads)


def add_load_options(parser: argparse.ArgumentParser, tensor_parallel: bool = False) -> None:
    """The tritonq.load() options every command that loads a model takes."""
    group = parser.add_argument_group("loading the model")
    group.add_argument("--dtype", choices=DTYPE_NAMES, default="auto",
                       help="compute dtype (auto: bf16 on CPUs with AVX512-BF16 / AMX, else fp32; on CUDA the "
                            "checkpoint's fp16, else bf16)")
    group.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    add_threads_option(group)
    group.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) of a hub id")
    group.add_argument("--gguf-file", default=None,
                       help="the .gguf file to load from a hub id or folder holding several (a .gguf path or a "
                            "folder of gguf-split shards needs none)")
    add_engine_options(group, tensor_parallel)


def add_engine_options(group, tensor_parallel: bool = False) -> None:
    """One option per EngineConfig field, with its default and help (config.py writes both once); the fields
    marked parallel (tensor / expert parallelism) only where tensor_parallel. A bool field is --NAME /
    --no-NAME; load_model hands the fields back as an EngineConfig."""
    for f in dataclasses.fields(EngineConfig):
        meta = f.metadata
        if meta.get("parallel") and not tensor_parallel:
            continue
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        kind = {"bool": argparse.BooleanOptionalAction}.get(f.type.split(" ")[0])
        if kind is not None:
            group.add_argument(flag, dest=f.name, action=kind, default=f.default, help=meta["help"])
        else:
            types = {"int": int, "float": float}
            group.add_argument(flag, dest=f.name, type=types.get(f.type.split(" ")[0], str), default=f.default,
                               choices=meta.get("choices"), metavar=meta.get("metavar"), help=meta["help"])


def check_device(parser: argparse.ArgumentParser, device: str | None) -> None:
    """fail() unless device (None: load's default) names one this machine has: cpu, or cuda / cuda:N with that
    GPU present (checked before the model loads; torch's own errors are tracebacks from deep inside load)."""
    if device is None:
        return
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        fail(parser, f"--device {device!r} is not a device name; expected cpu, cuda or cuda:N")
    if parsed.type not in ("cpu", "cuda"):
        fail(parser, f"--device {device}: tritonq runs on cpu or cuda (cuda:N); pass one of them")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        why = (f"this torch ({torch.__version__}) is built without CUDA" if torch.version.cuda is None
               else "torch finds no CUDA GPU (check the driver and CUDA_VISIBLE_DEVICES)")
        fail(parser, f"--device {device}: {why}; pass --device cpu, or install a CUDA build of torch")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        fail(parser, f"--device {device}: this machine has {count} CUDA GPU{'s' * (count != 1)} "
                     f"(cuda:0 to cuda:{count - 1}); pass one of them")


def load_model(parser: argparse.ArgumentParser, args: argparse.Namespace, warm_up: bool | None = None):
    """tritonq.load(args.model, the load options, warm_up); a device this machine lacks, or a checkpoint or option
    load refuses, ends in fail(). warm_up: True for commands that serve many requests (compile at load), False
    for one-shot ones (never compile; see tritonq.load)."""
    import tritonq

    check_device(parser, args.device)
    engine = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    try:
        config = EngineConfig(**engine)
    except (ValueError, TypeError) as e:
        fail(parser, e)
    options = dict(dtype=None if args.dtype == "auto" else args.dtype, device=args.device, revision=args.revision,
                   threads=args.threads, warm_up=warm_up, gguf_file=args.gguf_file)
    try:
        return tritonq.load(args.model, config=config, **options)
    except (ValueError, OSError) as e:  # what load refuses says what to change; the traceback adds nothing
        fail(parser, e)


# --------------------------------------------------------------------------------------- generate / chat

def _with_generation_options(parser: argparse.ArgumentParser, max_new_tokens: int) -> argparse.ArgumentParser:
    """parser with the sampling options (checked by `_parse_generation`) and the load options added."""
    _add_sampling_options(parser, max_new_tokens)
    add_load_options(parser)
    return parser


def _parse_generation(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parser's arguments from argv, the sampling options checked (a usage error otherwise)."""
    args = parser.parse_args(argv)
    _check_sampling(parser, args)
    return args


def _add_sampling_options(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="tokens to generate at most")
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    group.add_argument("--top-p", type=float, default=1.0, help="keep the most likely tokens up to this mass (1: off)")
    group.add_argument("--min-p", type=float, default=0.0,
                       help="keep tokens at least this fraction as likely as the most likely one (0: off)")
    group.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL-style penalty on seen tokens")
    group.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="end the text before TEXT (repeat for several)")
    group.add_argument("--seed", type=int, default=None, help="seed for repeatable sampling (default: random)")


def _sampling(args: argparse.Namespace) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repetition_penalty=args.repetition_penalty, stop=tuple(args.stop or ()),
                seed=args.seed)


def _check_sampling(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """GenerationConfig's own checks, before the model loads (it imports torch, but not the model)."""
    from tritonq.config import GenerationConfig
    try:
        GenerationConfig(**_sampling(args))
    except (TypeError, ValueError) as e:
        fail(parser, e)


def generate_parser(prog: str = "tritonq generate") -> argparse.ArgumentParser:
    parser = new_parser(prog, "Generate a completion of one prompt and stream it (the continuation only) to stdout.")
    parser.add_argument("model", help="checkpoint folder or Hugging Face id (dense, AWQ, GPTQ or FP8)")
    parser.add_argument("prompt", help='the text to continue; "-" reads it from stdin')
    return _with_generation_options(parser, max_new_tokens=128)


def generate_main(argv: list[str] | None = None, prog: str = "tritonq generate") -> None:
    parser = generate_parser(prog)
    args = _parse_generation(parser, argv)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        fail(parser, "the prompt is empty; give the text to continue")
    model = load_model(parser, args, warm_up=False)  # one prompt: a compile would cost more than it saves
    prompt_tokens = len(model.tokenizer(prompt).input_ids)  # what stream() encodes the text to
    text, start, first = [], time.perf_counter(), None
    try:
        for piece in model.stream(prompt, **_sampling(args)):
            first = first or time.perf_counter()
            text.append(piece)
            print(piece, end="", flush=True)
    except ValueError as e:  # a prompt the engine refuses (too long for max_seq_len, ...)
        fail(parser, e)
    print(flush=True)
    print(_stats_line(prompt_tokens, len(model.tokenizer("".join(text), add_special_tokens=False).input_ids),
                      start, first, time.perf_counter()), file=sys.stderr, flush=True)


def _stats_line(prompt_tokens: int, generated_tokens: int, start: float, first: float | None, end: float) -> str:
    """generate's last line (stderr): prompt tokens/s to the first text, time to it, decode tokens/s after it.
    The generated count is that of the text's tokens (EOS and a stop string excluded)."""
    if first is None:
        return f"prompt {prompt_tokens} tokens; no text generated in {end - start:.2f} s"
    decode = (f"{(generated_tokens - 1) / (end - first):.1f} tokens/s" if generated_tokens > 1 and end > first
              else "-")
    return (f"prompt {prompt_tokens} tokens, {prompt_tokens / (first - start):.1f} tokens/s; time to first token "
            f"{first - start:.3f} s; decode {generated_tokens} tokens, {decode}")


def chat_parser(prog: str = "tritonq chat") -> argparse.ArgumentParser:
    parser = new_parser(prog, "Chat with a model through its chat template: each line read is a user turn, the "
                              "reply streams to stdout. Ctrl-D (end of input) ends the chat.")
    parser.add_argument("model", help="checkpoint folder or Hugging Face id whose tokenizer has a chat template")
    parser.add_argument("--system-prompt", default=None, help="a system message before the first turn")
    return _with_generation_options(parser, max_new_tokens=256)


def chat_main(argv: list[str] | None = None, prog: str = "tritonq chat") -> None:
    parser = chat_parser(prog)
    args = _parse_generation(parser, argv)
    model = load_model(parser, args, warm_up=True)  # compiled now, not at the first line typed
    if model.tokenizer.chat_template is None:
        fail(parser, f"{args.model}'s tokenizer has no chat template; use `tritonq generate` for plain text")
    system = [] if args.system_prompt is None else [{"role": "system", "content": args.system_prompt}]
    turns: list[dict] = []  # the conversation after the system prompt, oldest first
    said = set()  # what was said about the context, so that each is said once
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            break
        if not line.strip():
            continue
        turns.append({"role": "user", "content": line})
        prompt, max_new_tokens = _fit_context(model, system, turns, args.max_new_tokens, said, prog)
        if prompt is None:
            turns.pop()  # this line alone leaves no room for a reply: it is not kept
            continue
        reply = []
        try:
            for piece in model.stream(prompt, **{**_sampling(args), "max_new_tokens": max_new_tokens}):
                reply.append(piece)
                print(piece, end="", flush=True)
        except ValueError as e:  # a request the engine refuses for another reason than its length
            fail(parser, e)
        print(flush=True)
        turns.append({"role": "assistant", "content": "".join(reply)})
    if interactive:
        print()


def _fit_context(model, system: list[dict], turns: list[dict], max_new_tokens: int, said: set, prog: str
                 ) -> tuple[list[int] | None, int]:
    """(the prompt ids, the reply's max_new_tokens) of the conversation within model.max_seq_len: the oldest
    turns are dropped from `turns` (the system prompt is kept) until prompt + max_new_tokens fit, and then, if the
    newest line alone leaves less room, max_new_tokens is cut to what fits. Each of those is said on stderr the
    first time (`said`). (None, 0), `turns` untouched, when the newest line leaves no room at all (said each time)."""
    start = 0  # turns alternate user / reply and end with the new user line: drop whole pairs, oldest first
    prompt = model.chat_prompt(system + turns)
    while len(prompt) + max_new_tokens > model.max_seq_len and start < len(turns) - 1:
        start += 2
        prompt = model.chat_prompt(system + turns[start:])
    room = model.max_seq_len - len(prompt)
    if room < 1:
        print(f"{prog}: this line makes a prompt of {len(prompt)} tokens, which leaves no room for a reply within "
              f"max_seq_len={model.max_seq_len}; say it shorter (or raise --max-seq-len).", file=sys.stderr,
              flush=True)
        return None, 0
    if start:
        del turns[:start]
        _say_once(said, "dropped", f"{prog}: the conversation outgrew max_seq_len={model.max_seq_len} tokens with "
                                   f"room for {max_new_tokens} new ones; dropping the oldest turns (the system "
                                   "prompt stays). Said once.")
    if room < max_new_tokens:
        _say_once(said, "capped", f"{prog}: replies are cut to the room left in max_seq_len={model.max_seq_len} "
                                  f"(here {room} of --max-new-tokens {max_new_tokens}). Said once.")
    return prompt, min(room, max_new_tokens)


def _say_once(said: set, what: str, message: str) -> None:
    if what not in said:
        said.add(what)
        print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------- quantize

def quantize_parser(prog: str = "tritonq quantize") -> argparse.ArgumentParser:
    parser = new_parser(prog, "Write a quantized checkpoint (AWQ, GPTQ, FP8, MXFP4 or W8A8 INT8) from a dense one, in the "
                              "exact on-disk format AutoAWQ / GPTQModel / llm-compressor / vLLM read; see "
                              "tritonq/quantize/writer.py.")
    parser.add_argument("src", help="dense checkpoint folder (transformers save_pretrained)")
    parser.add_argument("dst", help="output folder (new or empty; written beside it, then renamed into place)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it holds anything")
    parser.add_argument("--format", required=True, choices=["awq", "gptq", "fp8", "mxfp4", "w8a8"],
                        help="checkpoint format to write (mxfp4: gpt-oss's MoE experts; w8a8: compressed-tensors "
                             "int-quantized, INT8 weights and activations)")
    parser.add_argument("--group-size", type=int, default=128, help="rows per group along K (-1: one group)")
    parser.add_argument("--sym", dest="sym", action="store_true", help="symmetric (GPTQ only; default for GPTQ)")
    parser.add_argument("--asym", dest="sym", action="store_false", help="asymmetric zero points")
    parser.set_defaults(sym=None)
    parser.add_argument("--act-order", action="store_true", help="GPTQ desc_act with a g_idx")
    parser.add_argument("--bits", type=int, default=4, choices=[4, 8], help="GPTQ bits")
    parser.add_argument("--checkpoint-format", default="gptq", choices=["gptq", "gptq_v2"],
                        help="GPTQ on-disk zero points: v1 (stored minus one) or v2")
    parser.add_argument("--fp8-scheme", default="tensor", choices=["tensor", "channel", "block"],
                        help="FP8 weight scales: one per tensor, per output channel, or per 128x128 block")
    parser.add_argument("--w8a8-scheme", default="channel", choices=["channel", "tensor"],
                        help="W8A8 weight scales: one per output channel or one per tensor")
    parser.add_argument("--modules-to-not-convert", nargs="*", default=None, help="name substrings left dense")
    add_threads_option(parser)
    calib = parser.add_argument_group("calibration (--method gptq / awq)")
    calib.add_argument("--method", default="rtn", choices=["rtn", "gptq", "awq"],
                       help="rtn: round to nearest; gptq (--format gptq) / awq (--format awq): calibrated")
    calib.add_argument("--calibration", default=None, help="text file of calibration text")
    calib.add_argument("--samples", type=int, default=128, help="calibration windows")
    calib.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    calib.add_argument("--damp", type=float, default=0.01, help="GPTQ dampening, fraction of mean diag(H)")
    calib.add_argument("--block-size", type=int, default=128, help="GPTQ lazy-update block (columns)")
    calib.add_argument("--awq-clip", action="store_true", help="AWQ: also search per-group weight clipping")
    calib.add_argument("--smooth", type=float, default=None, metavar="ALPHA",
                       help="W8A8: fold SmoothQuant scales (migration strength ALPHA, usually 0.5) into the norms "
                            "before q|k|v and gate|up, from --calibration text")
    return parser


def quantize_main(argv: list[str] | None = None, prog: str = "tritonq quantize") -> None:
    parser = quantize_parser(prog)
    a = parser.parse_args(argv)
    if a.format == "awq" and a.sym:
        parser.error("AWQ GEMM checkpoints are asymmetric (zero_point: true); drop --sym")
    from tritonq.quantize.writer import write_quantized

    options = {"group_size": a.group_size, "modules_to_not_convert": a.modules_to_not_convert}
    if a.format == "gptq":
        options |= {"bits": a.bits, "sym": True if a.sym is None else a.sym, "act_order": a.act_order,
                    "checkpoint_format": a.checkpoint_format}
    if a.format == "fp8":
        options = {"fp8_scheme": a.fp8_scheme, "modules_to_not_convert": a.modules_to_not_convert}
    if a.format == "mxfp4":
        options = {"modules_to_not_convert": a.modules_to_not_convert}
    if a.format == "w8a8":
        options = {"w8a8_scheme": a.w8a8_scheme, "modules_to_not_convert": a.modules_to_not_convert}
    elif a.smooth is not None:
        parser.error("--smooth applies to --format w8a8 only")
    calibration = {"file": a.calibration, "samples": a.samples, "seq_len": a.seq_len, "damp": a.damp,
                   "block_size": a.block_size, "clip": a.awq_clip, "smooth": a.smooth}
    set_threads(a.threads)
    try:
        written = write_quantized(a.src, a.dst, a.format, method=a.method, calibration=calibration,
                                  overwrite=a.overwrite, **options)
    except (ValueError, OSError) as e:  # bad input: one line that says what to change, no traceback
        fail(parser, e)
    print(f"wrote {written}")


# --------------------------------------------------------------------------------------- the command

@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand: its one-line summary, and where its parser and main live (imported when it runs)."""
    summary: str
    module: str
    parser: str = "build_parser"
    main: str = "main"

    def parser_for(self, prog: str) -> argparse.ArgumentParser:
        return getattr(importlib.import_module(self.module), self.parser)(prog)

    def run(self, argv: list[str], prog: str):
        return getattr(importlib.import_module(self.module), self.main)(argv, prog=prog)


COMMANDS = {
    "generate": Command("stream a completion of one prompt to stdout", __name__, "generate_parser", "generate_main"),
    "chat": Command("an interactive chat through the model's chat template", __name__, "chat_parser", "chat_main"),
    "serve": Command("the OpenAI-compatible server (pip install 'tritonq[serve]')", "tritonq.serve.__main__"),
    "quantize": Command("write an AWQ / GPTQ / FP8 checkpoint from a dense one", __name__, "quantize_parser",
                        "quantize_main"),
    "eval": Command("perplexity of a text file, or lm-evaluation-harness tasks", "tritonq.eval.__main__"),
    "bench": Command("run a benchmark (list them: tritonq bench --help)", "tritonq.bench.__main__"),
    "tune": Command("sweep a kernel's launch configs and write the fastest", "tritonq.tune.cli"),
    "check": Command("run the kernel tests on this machine, one line each", "tritonq.check"),
    "demo": Command("quantize the shipped Shakespeare model to AWQ int4 and generate", "tritonq.demo"),
}


def build_parser(prog: str = "tritonq") -> argparse.ArgumentParser:
    from tritonq import __version__

    parser = new_parser(prog, __doc__.split("\n\n")[0], epilog=f"`{prog} COMMAND --help` shows a command's options.")
    parser.add_argument("--version", action="version", version=f"tritonq {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, command in COMMANDS.items():
        commands.add_parser(name, help=command.summary, add_help=False)
    return parser


def main(argv: list[str] | None = None, prog: str = "tritonq") -> int | None:
    """Run the command; its exit status is returned (`check`: 1 when a test failed) or raised (SystemExit)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:  # the subcommand's own parser takes everything after its name
        return COMMANDS[argv[0]].run(argv[1:], prog=f"{prog} {argv[0]}")
    parser = build_parser(prog)
    if argv and not argv[0].startswith("-"):
        fail(parser, f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
    parser.parse_args(argv)  # --help, --version, or an unknown option (exit 2)
    parser.print_help(sys.stderr)
    raise SystemExit(2)  # no command given


if __name__ == "__main__":
    sys.exit(main())
