"""Prometheus metrics of the server, named after vLLM's (`tritonq:` prefix, `model_name` label).

Gauges are refreshed by the engine thread after every step from the scheduler and block manager;
counters and histograms are fed as requests arrive, produce tokens and finish. Each app has its
own CollectorRegistry, so two servers in one process (tests) do not share counts.
"""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def engine_state(engine):
    """(scheduler, block manager) of an engine; the gauges read these two."""
    return engine.scheduler, engine.block_manager


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def make(kind, name, doc, **kw):
            metric = kind(f"tritonq:{name}", doc, list(labels), registry=self.registry, **kw)
            return metric.labels(**labels)

        self.running = make(Gauge, "num_requests_running", "Requests holding KV blocks (prefilling or decoding).")
        self.waiting = make(Gauge, "num_requests_waiting", "Requests queued for admission (new or preempted).")
        self.kv_usage = make(Gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).")
        self.free_blocks = make(Gauge, "kv_cache_free_blocks", "KV-cache blocks free (cached prefixes count as free).")
        self.total_blocks = make(Gauge, "kv_cache_total_blocks", "KV-cache blocks in all.")
        self.prefix_hit_rate = make(Gauge, "prefix_cache_hit_rate",
                                    "Prompt tokens served from the prefix cache / prompt tokens looked up, since start.")
        self.prefix_queries = make(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = make(Counter, "prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.preemptions = make(Counter, "num_preemptions", "Running requests preempted for lack of KV blocks.")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of accepted requests.")
        self.generation_tokens = make(Counter, "generation_tokens", "Tokens generated.")
        self.ttft = make(Histogram, "time_to_first_token_seconds", "Arrival to first generated token.",
                         buckets=_LATENCY_BUCKETS)
        self.tpot = make(Histogram, "time_per_output_token_seconds",
                         "(end-to-end - time to first token) / (tokens - 1), per request.", buckets=_LATENCY_BUCKETS)
        self.e2e = make(Histogram, "e2e_request_latency_seconds", "Arrival to last token.", buckets=_LATENCY_BUCKETS)
        self.spec_draft_tokens = make(Counter, "spec_decode_num_draft_tokens",
                                      "Draft tokens proposed (speculative decoding).")
        self.spec_accepted_tokens = make(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_verifications = make(Counter, "spec_decode_num_drafts",
                                       "Sequence steps that verified >= 1 draft token.")
        self.spec_acceptance_rate = make(Gauge, "spec_decode_acceptance_rate",
                                         "Accepted / proposed draft tokens, since start.")
        self.spec_mean_accepted_length = make(Gauge, "spec_decode_mean_accepted_length",
                                              "Tokens emitted per verification (accepted + 1), since start.")
        self._success = Counter("tritonq:request_success", "Requests finished, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._labels = labels
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0, "proposed": 0, "accepted": 0, "verifications": 0}
        self._logged = (None, 0.0, 0.0)  # (time, prompt tokens, generated tokens) at the last throughput line

    def log_throughput(self, now: float, interval: float) -> None:
        """(engine thread, after update_engine) While requests run or wait, one INFO line every `interval` seconds
        (0: never), and one for the last stretch when they are done, as vLLM logs: running and waiting requests,
        prompt tokens accepted and tokens generated per second over the stretch, KV-cache use. On stderr like
        every log line: never inside streamed text."""
        def value(name: str) -> float:
            return self.registry.get_sample_value(f"tritonq:{name}", self._labels) or 0.0
        if not interval:
            return
        totals = (value("prompt_tokens_total"), value("generation_tokens_total"))
        running, waiting = value("num_requests_running"), value("num_requests_waiting")
        start, *counted = self._logged
        busy = running or waiting
        if start is None:  # the first step after idling: the stretch starts now, with the work just accepted
            self._logged = (now, *counted)
        elif (now - start >= interval or not busy) and now > start and totals != tuple(counted):
            prompt, generated = ((total - before) / (now - start) for total, before in zip(totals, counted))
            logging.getLogger("tritonq.serve").info(
                "running %d, waiting %d requests; prompt %.1f tokens/s, generation %.1f tokens/s; KV cache %.1f%% "
                "used", running, waiting, prompt, generated, 100 * value("kv_cache_usage_perc"))
            self._logged = (now, *totals)
        if not busy:  # idle from here (the engine thread waits for work): the next stretch starts with it
            self._logged = (None, *totals)

    def update_engine(self, engine) -> None:
        """Refresh gauges and the cumulative counters the engine keeps itself (engine thread)."""
        scheduler, blocks = engine_state(engine)
        self.running.set(scheduler.num_running)
        self.waiting.set(scheduler.num_waiting)
        self.kv_usage.set(blocks.usage)
        self.free_blocks.set(blocks.num_free_blocks)
        self.total_blocks.set(blocks.num_blocks)
        for key, metric, value in (("preemptions", self.preemptions, scheduler.num_preemptions),
                                   ("queries", self.prefix_queries, blocks.prefix_queries),
                                   ("hits", self.prefix_hits, blocks.prefix_hits)):
            if value > self._seen[key]:
                metric.inc(value - self._seen[key])
                self._seen[key] = value
        if blocks.prefix_queries:
            self.prefix_hit_rate.set(blocks.prefix_hits / blocks.prefix_queries)
        spec = getattr(engine, "speculation", None)  # None: a stand-in engine (tests)
        if spec is not None and spec.verifications:
            for key, metric in (("proposed", self.spec_draft_tokens), ("accepted", self.spec_accepted_tokens),
                                ("verifications", self.spec_verifications)):
                value = getattr(spec, key)
                if value > self._seen[key]:
                    metric.inc(value - self._seen[key])
                    self._seen[key] = value
            self.spec_acceptance_rate.set(spec.acceptance_rate)
            self.spec_mean_accepted_length.set(spec.mean_accepted_length)

    def request_finished(self, arrival: float, first: float | None, tokens: int, now: float,
                         reason: str | None) -> None:
        self.e2e.observe(now - arrival)
        if first is not None and tokens > 1:
            self.tpot.observe((now - first) / (tokens - 1))
        self._success.labels(finished_reason=reason or "unknown", **self._labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
