"""Command line: perplexity of a text file, or lm-evaluation-harness tasks, for one model.

    python -m tritonq.eval perplexity MODEL FILE [--context N] [--stride S] [--quantize int4] ...
    python -m tritonq.eval lm_eval --model-path MODEL --tasks TASK[,TASK...] [--include-path DIR] ...

MODEL is a checkpoint folder or a Hugging Face id (dense, AWQ, GPTQ or FP8). Bad input ends with a
one-line error and exit status 2 before the model is loaded where it can be checked without it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tritonq.cli import add_load_options, fail, load_model, new_parser, require


def build_parser(prog: str = "python -m tritonq.eval") -> argparse.ArgumentParser:
    parser = new_parser(prog, __doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="{perplexity,lm_eval}")
    ppl = commands.add_parser("perplexity", help="sliding-window perplexity of a UTF-8 text file",
                              description="Sliding-window perplexity of a UTF-8 text file.",
                              formatter_class=parser.formatter_class)
    ppl.add_argument("model", help="checkpoint folder or Hugging Face id")
    ppl.add_argument("file", type=Path, help="UTF-8 text, scored as one text")
    ppl.add_argument("--context", type=int, default=None,
                     help="tokens per window (default: max_seq_len; a model trained on shorter windows scores "
                          "better at its training length)")
    ppl.add_argument("--stride", type=int, default=None, help="tokens each window moves on (default: context // 2)")
    ppl.add_argument("--json", type=Path, default=None, help="also write the result here")
    add_load_options(ppl)
    harness = commands.add_parser("lm_eval", help="lm-evaluation-harness tasks (pip install 'tritonq[eval]')",
                                  description="lm-evaluation-harness tasks on the model (pip install 'tritonq[eval]').",
                                  formatter_class=parser.formatter_class)
    harness.add_argument("--model-path", dest="model", required=True, help="checkpoint folder or Hugging Face id")
    harness.add_argument("--tasks", required=True, help="comma-separated lm_eval task names")
    harness.add_argument("--include-path", default=None, help="folder of extra task YAML files")
    harness.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    harness.add_argument("--limit", type=float, default=None, help="examples per task (a fraction if < 1)")
    harness.add_argument("--seed", type=int, default=0, help="lm_eval's random, numpy, torch and few-shot seeds")
    harness.add_argument("--output-path", type=Path, default=None, help="write lm_eval's results JSON here")
    harness.add_argument("--log-samples", action="store_true", help="keep per-sample results in --output-path")
    add_load_options(harness)
    return parser


def parse_args(argv: list[str] | None = None, prog: str = "python -m tritonq.eval"
               ) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = build_parser(prog)
    return parser, parser.parse_args(argv)


def perplexity(parser, args) -> None:
    from tritonq.eval.perplexity import check_window

    # what can be checked before loading (max_seq_len is known only after)
    check_window(sys.maxsize if args.context is None else args.context, args.stride, max_seq_len=sys.maxsize)
    if not args.file.is_file():
        raise ValueError(f"{args.file} is not a file; give a UTF-8 text file to score.")
    try:
        text = args.file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{args.file} is not UTF-8 text ({e}); convert it first.") from e
    if not text.strip():
        raise ValueError(f"{args.file} has no text to score; give a non-empty file.")
    model = load_model(parser, args)
    out = model.perplexity(text, context=args.context, stride=args.stride, return_dict=True, progress=True)
    print(f"perplexity {out.perplexity:.4f} (mean NLL {out.mean_nll:.4f} nats over {out.num_tokens} tokens, "
          f"{out.num_windows} windows of {out.context} tokens, stride {out.stride})")
    if args.context is None:
        print(_context_hint(args.model, out.context), file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "file": str(args.file), **out.__dict__}, indent=2))


def _context_hint(model: str, context: int) -> str:
    """What to know about the default window: its length is the model's longest, not what it was trained on."""
    hint = (f"hint: windows of {context} tokens, the default (max_seq_len); a model trained on shorter sequences "
            "than its position limit scores better with --context near its training length")
    training = Path(model) / "training.json"  # tritonq.default_model.train's record: seq_len it trained on
    if training.is_file():
        seq_len = json.loads(training.read_text()).get("seq_len")
        hint += f" (this one trained on {seq_len}-token windows: {training})" if seq_len else ""
    return hint


def lm_eval(parser, args) -> None:
    require(parser, ("lm_eval",), "eval")
    import lm_eval as harness
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table
    from tritonq.eval.harness import TritonQLM

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError(f"--tasks {args.tasks!r} names no task; give comma-separated lm_eval task names.")
    if args.log_samples and args.output_path is None:
        raise ValueError("--log-samples keeps per-sample results in the --output-path file; give --output-path.")
    manager = None
    if args.include_path:  # indexing lm_eval's thousands of built-in tasks takes a minute: skip it when unneeded
        local = TaskManager(include_path=args.include_path, include_defaults=False)
        manager = local if all(t in local.all_tasks for t in tasks) else None
    manager = manager or TaskManager(include_path=args.include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm_eval task(s) {unknown}; list them with `lm_eval ls tasks` "
                         "(add --include-path for your own YAML tasks).")
    model = TritonQLM(model=load_model(parser, args))
    results = harness.simple_evaluate(model=model, tasks=tasks, num_fewshot=args.num_fewshot,
                                      limit=args.limit, task_manager=manager, log_samples=args.log_samples,
                                      random_seed=args.seed, numpy_random_seed=args.seed, torch_random_seed=args.seed,
                                      fewshot_random_seed=args.seed)
    print(make_table(results))
    if args.output_path:
        args.output_path.write_text(json.dumps(results, indent=2, default=str))


def main(argv: list[str] | None = None, prog: str = "python -m tritonq.eval") -> None:
    parser, args = parse_args(argv, prog)
    parser.prog = f"{parser.prog} {args.command}"
    try:
        {"perplexity": perplexity, "lm_eval": lm_eval}[args.command](parser, args)
    except (ValueError, OSError) as e:  # bad input: one line that says what to change, no traceback
        fail(parser, e)


if __name__ == "__main__":
    main()
