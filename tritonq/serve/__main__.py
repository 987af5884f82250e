"""Command line: load a model, then serve it with uvicorn until Ctrl-C / SIGTERM.

On a signal, every running stream gets an error chunk and [DONE] (so clients see why it ended),
uvicorn closes the connections, the engine thread stops and the process exits with status 0.
If the engine cannot continue (a device error, or its thread died), every request gets an error,
/health answers 503 with the reason for DEAD_EXIT_DELAY_S, then uvicorn shuts down and the process
exits with status 1, so a supervisor (systemd, Kubernetes) restarts it.
Tensor parallel: `torchrun --nproc-per-node N -m tritonq.serve MODEL` (several machines: --nnodes and
--rdzv-endpoint); rank 0 serves, the other ranks step the same schedule (tritonq.serve.ranks).
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import socket
import sys
import threading

from tritonq.cli import add_load_options, fail, load_model, new_parser, require
from tritonq.serve.limits import Limits

DEAD_EXIT_DELAY_S = 2.0  # /health reports the death this long before the process exits
SERVE_MODULES = ("fastapi", "uvicorn", "pydantic", "prometheus_client")  # the [serve] extra


def build_parser(prog: str = "python -m tritonq.serve") -> argparse.ArgumentParser:
    parser = new_parser(prog, __doc__.splitlines()[0])
    parser.add_argument("model", help="local folder or Hugging Face id (dense, AWQ, GPTQ or FP8)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=_port, default=8000, help="TCP port to listen on (1-65535)")
    parser.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: MODEL)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health (default: the "
                             "TRITONQ_API_KEY environment variable if set; an empty key is refused)")
    parser.add_argument("--open-metrics", action="store_true",
                        help="leave /metrics open without the API key (for a Prometheus scraper)")
    parser.add_argument("--max-request-bytes", type=int, default=None,
                        help="refuse (413) request bodies larger than this, before parsing (default 2 MiB)")
    parser.add_argument("--max-waiting", type=int, default=None,
                        help="answer 429 once this many sequences (prompts x n) wait for their first token "
                             "(default: 8 x --max-num-seqs, so one request cannot queue unbounded work)")
    limits = parser.add_argument_group("fairness caps per request (docs/server_limits.md)")
    limits.add_argument("--max-request-tokens", type=int, default=None,
                        help="refuse (400) a request that may generate more tokens than this, prompts x n x "
                             "max_tokens (max_tokens left out: the rest of the context) (default: 16 x max_seq_len)")
    limits.add_argument("--max-stop-strings", type=int, default=Limits.max_stop_strings,
                        help="refuse (400) a request with more stop strings than this")
    limits.add_argument("--max-stop-chars", type=int, default=Limits.max_stop_chars,
                        help="refuse (400) a request whose stop strings have more characters in all than this")
    limits.add_argument("--body-timeout", type=float, default=Limits.body_timeout_s, metavar="SECONDS",
                        help="answer 408 and close the connection when a request body has not arrived whole "
                             "within this many seconds")
    parser.add_argument("--log-stats-interval", type=float, default=5.0, metavar="SECONDS",
                        help="while busy, log running / waiting requests, prompt and generation tokens/s and KV-cache "
                             "use this often (0: never)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="uvicorn's log level")
    add_load_options(parser, tensor_parallel=True)
    return parser


def _port(text: str) -> int:
    """--port's type: a TCP port number, 1-65535 (argparse turns the error into one usage line)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port; expected 1-65535")
    return port


def _listen(parser: argparse.ArgumentParser, host: str, port: int) -> socket.socket:
    """A socket bound to host:port, made before the model loads so that a busy port or an address this machine
    does not have ends in fail() at once; uvicorn then serves on it (no second bind, so no race)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        fail(parser, f"--host {host}: {e.strerror}; pass an address of this machine (127.0.0.1, 0.0.0.0, ...)")
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses a TIME_WAIT port
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        fail(parser, f"cannot listen on {host}:{port}: {e.strerror}; stop the process using it or pass another "
                     "--port")
    return sock


def parse_args(argv: list[str] | None = None, prog: str = "python -m tritonq.serve"
               ) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.max_waiting is not None and args.max_waiting < 0:
        parser.error(f"--max-waiting is {args.max_waiting}; expected >= 0")
    if args.speculative is not None:
        from tritonq.engine.speculative import SpeculativeConfig
        try:
            SpeculativeConfig.parse(args.speculative)
        except (ValueError, TypeError) as e:
            parser.error(f"--speculative-config: {e}")
    if not args.log_stats_interval >= 0:
        parser.error(f"--log-stats-interval is {args.log_stats_interval}; expected seconds >= 0")
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        parser.error(f"--max-request-bytes is {args.max_request_bytes}; expected >= 1")
    for name in ("max_request_tokens", "max_stop_strings", "max_stop_chars"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} is {getattr(args, name)}; expected >= 1")
    if not (args.body_timeout > 0 and math.isfinite(args.body_timeout)):
        parser.error(f"--body-timeout is {args.body_timeout}; expected a number of seconds > 0")
    args.api_key_source = "--api-key"
    if args.api_key is None and "TRITONQ_API_KEY" in os.environ:
        args.api_key, args.api_key_source = os.environ["TRITONQ_API_KEY"], "TRITONQ_API_KEY"
    return parser, args


def _server_class():
    """uvicorn.Server subclass (defined on use: uvicorn is the [serve] extra, absent from a light install)."""
    import uvicorn

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
                self.loop.call_soon_threadsafe(self.loop.call_later, DEAD_EXIT_DELAY_S, setattr, self, "should_exit",
                                               True)
            else:
                self.should_exit = True

    return _Server


def main(argv: list[str] | None = None, prog: str = "python -m tritonq.serve") -> None:
    parser, args = parse_args(argv, prog)
    require(parser, SERVE_MODULES, "serve")
    import uvicorn

    from tritonq.serve.app import check_api_key, create_app
    from tritonq.serve.ranks import LeaderEngine, control_group, follow

    try:
        check_api_key(args.api_key, args.api_key_source)
    except ValueError as e:
        fail(parser, e)

    if args.tensor_parallel not in (None, 1) and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        fail(parser, f"--tensor-parallel {args.tensor_parallel} needs {args.tensor_parallel} processes: start the "
                     f"server with `torchrun --nproc-per-node {args.tensor_parallel} -m tritonq.serve MODEL ...`")
    # rank 0 serves; the port is taken before the model loads (a busy one is refused at once)
    sock = _listen(parser, args.host, args.port) if int(os.environ.get("RANK", "0")) == 0 else None
    model = _load_off_main_thread(parser, args)
    leader = None
    if model.world > 1:
        group = control_group()
        if model.rank > 0:  # every rank but 0 replays rank 0's engine calls until it stops
            follow(model.engine, group)
            return
        leader = model.engine = LeaderEngine(model.engine, group)
    server = None
    max_waiting = 8 * args.max_num_seqs if args.max_waiting is None else args.max_waiting
    limits = Limits(max_stop_strings=args.max_stop_strings, max_stop_chars=args.max_stop_chars,
                    max_request_tokens=args.max_request_tokens or 16 * model.max_seq_len,
                    body_timeout_s=args.body_timeout)
    app = create_app(model, args.served_model_name or args.model, api_key=args.api_key, max_waiting=max_waiting,
                     open_metrics=args.open_metrics, on_dead=lambda reason: server.engine_died(reason),
                     limits=limits,
                     log_interval=args.log_stats_interval,
                     **({} if args.max_request_bytes is None else {"max_request_bytes": args.max_request_bytes}))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=10)
    server = _server_class()(config, app.state.engine_loop)
    server.run(sockets=[sock])
    if app.state.engine_loop.dead is not None:
        raise SystemExit(1)  # a supervisor restarts us; status 0 would say "stopped on purpose" (torchrun: all ranks)
    if leader is not None:  # the engine thread has stopped (app shutdown): release the other ranks
        try:
            leader.close()
        except RuntimeError:  # torchrun's SIGTERM reached them first: they have stopped already
            print("tritonq.serve: the other ranks had already stopped", file=sys.stderr, flush=True)


def _load_off_main_thread(parser, args):
    """load_model in a thread that ends when it is done, so that the engine thread is the process's only
    OpenMP master. libgomp keeps a team of worker threads for each thread that has run a parallel region;
    with the main thread's team alive beside the engine thread's there are more OpenMP threads than cores,
    libgomp stops spinning its idle workers, and each parallel op of the engine thread waits for them to
    wake (measured on 2 cores: index_select 6.5 -> 68 us; the AWQ model's batch-1 decode step 7.4 -> 11.3 ms,
    the server's inter-token latency 12 ms). A team ends with its thread. The main thread then runs only
    the HTTP loop, which calls no parallel op."""
    outcome = {}

    def load():
        try:
            outcome["model"] = load_model(parser, args, warm_up=True)  # compiled before /health answers
        except BaseException as error:  # noqa: BLE001 - fail()'s SystemExit too: re-raised on the main thread
            outcome["error"] = error

    loader = threading.Thread(target=load, name="tritonq-load", daemon=True)  # daemon: Ctrl-C still exits
    loader.start()
    loader.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["model"]


if __name__ == "__main__":
    main()
