"""Command line: load a model, then serve it with uvicorn until Ctrl-C / SIGTERM.

On a signal, every running stream gets an error chunk and [DONE] (so clients see why it ended),
uvicorn closes the connections, the engine thread stops and the process exits with status 0.
If the engine cannot continue (a device error, or its thread died), every request gets an error,
/health answers 503 with the reason for DEAD_EXIT_DELAY_S, then uvicorn shuts down and the process
exits with status 1, so a supervisor (systemd, Kubernetes) restarts it.
"""
from __future__ import annotations

import argparse
import asyncio
import sys

import torch
import uvicorn

DEAD_EXIT_DELAY_S = 2.0  # /health reports the death this long before the process exits
DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tritonq.serve", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="local folder or Hugging Face id (dense, AWQ, GPTQ or FP8)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: MODEL)")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="sequences running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step")
    parser.add_argument("--max-seq-len", type=int, default=None, help="prompt + completion tokens per request")
    parser.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache budget (GiB)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health")
    parser.add_argument("--open-metrics", action="store_true",
                        help="leave /metrics open without the API key (for a Prometheus scraper)")
    parser.add_argument("--max-request-bytes", type=int, default=None,
                        help="refuse (413) request bodies larger than this, before parsing (default 2 MiB)")
    parser.add_argument("--max-waiting", type=int, default=None,
                        help="answer 429 once this many sequences (prompts x n) wait for their first token "
                             "(default: 8 x --max-num-seqs, so one request cannot queue unbounded work)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="auto")
    parser.add_argument("--quantize", default=None, help='quantize a dense checkpoint on load: "int4", "fp8", ...')
    parser.add_argument("--tensor-parallel", type=int, default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_tokens": 4}\' or '
                             '\'{"method": "draft", "model": "PATH_OR_ID", "num_tokens": 4}\' (see tritonq.load)')
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    if args.max_waiting is not None and args.max_waiting < 0:
        parser.error(f"--max-waiting is {args.max_waiting}; expected >= 0")
    if args.speculative_config is not None:
        from tritonq.engine.speculative import SpeculativeConfig
        try:
            SpeculativeConfig.parse(args.speculative_config)
        except (ValueError, TypeError) as e:
            parser.error(f"--speculative-config: {e}")
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        parser.error(f"--max-request-bytes is {args.max_request_bytes}; expected >= 1")
    return args


class _Server(uvicorn.Server):
    """uvicorn.Server that ends the running streams on the first signal and exits 0 afterwards
    (uvicorn's own handler re-raises the signal after shutdown, which kills the process)."""

    def __init__(self, config, engine_loop):
        super().__init__(config)
        self.engine_loop = engine_loop
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None):
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:  # a second signal: stop waiting for connections
            self.force_exit = True
            return
        self.should_exit = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.engine_loop.fail_all, "the server is shutting down")

    def engine_died(self, reason: str) -> None:
        """(engine thread) The engine cannot continue: shut down after DEAD_EXIT_DELAY_S (main exits 1)."""
        print(f"tritonq.serve: the engine cannot continue ({reason}); shutting down to be restarted",
              file=sys.stderr, flush=True)
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.call_later, DEAD_EXIT_DELAY_S, setattr, self, "should_exit", True)
        else:
            self.should_exit = True


def main(argv: list[str] | None = None) -> None:
    import tritonq
    from tritonq.serve.app import create_app

    args = parse_args(argv)
    model = tritonq.load(args.model, dtype=DTYPES[args.dtype], device=args.device, quantize=args.quantize,
                         max_seq_len=args.max_seq_len, tensor_parallel=args.tensor_parallel,
                         max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                         kv_cache_gb=args.kv_cache_gb, speculative=args.speculative_config)
    if model.world > 1:
        raise SystemExit("tensor parallel serving is not supported yet: every rank would need the same requests; "
                         "run with --tensor-parallel 1")
    server = None
    max_waiting = 8 * args.max_num_seqs if args.max_waiting is None else args.max_waiting
    app = create_app(model, args.served_model_name or args.model, api_key=args.api_key, max_waiting=max_waiting,
                     open_metrics=args.open_metrics, on_dead=lambda reason: server.engine_died(reason),
                     **({} if args.max_request_bytes is None else {"max_request_bytes": args.max_request_bytes}))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=10)
    server = _Server(config, app.state.engine_loop)
    server.run()
    if app.state.engine_loop.dead is not None:
        raise SystemExit(1)  # a supervisor restarts us; status 0 would say "stopped on purpose"


if __name__ == "__main__":
    main()
