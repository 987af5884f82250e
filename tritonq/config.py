"""The options a model runs with, each checked once when its config is made (clear errors, before any
work): `EngineConfig` (what `tritonq.load` takes for the engine and the KV cache) and `GenerationConfig`
(how one request generates), with `SpeculativeConfig` (speculative decoding, an EngineConfig field).
tritonq.api.load builds the EngineConfig and hands it whole to the engine (Engine, kv_cache_blocks), which take it as
made: below here its rules are asserts, not checks.

Imports neither torch nor any other tritonq module: the models, the engine and the command lines
(before torch loads) all import it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

# tritonq.load's kv_cache_dtype: "auto" stores K/V in the model dtype; "fp8" (float8_e4m3fn, one scale per layer
# for k and for v) and "int8" (one scale per token and kv head) store 1 byte per value (kernels/attention/pages.py).
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
QUANTIZE_ON_LOAD = ("int4", "fp8", "fp8-mlp")  # tritonq.formats.dense.QUANTIZE_ON_LOAD (a test keeps them equal)

MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for per token (OpenAI's limit)
GREEDY_BELOW = 1e-5  # temperatures in (0, GREEDY_BELOW) are taken as 0 (greedy); see GenerationConfig


def check_int(name: str, value, low: int) -> None:
    # bool is an int subclass: True would silently mean 1, so it is refused like a str or a float
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}); expected an int >= {low}.")
    if value < low:
        raise ValueError(f"{name}={value}; expected an int >= {low}.")


def check_float(name: str, value, ok, expected: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}); expected a number {expected}.")
    if not (math.isfinite(value) and ok(value)):
        raise ValueError(f"{name}={value}; expected a finite number {expected}.")


@dataclass(frozen=True)
class GenerationConfig:
    """How one request generates; every field is checked (types strictly: True is not an int, "3" not a
    number) when the config is made, so a bad value never reaches the engine.

    max_new_tokens: tokens to generate at most (>= 0).
    temperature: >= 0; 0 is greedy (argmax). Values below GREEDY_BELOW (1e-5) are stored as 0.0:
        dividing logits by them overflows float32 to inf, which breaks sampling and the top-k filter.
    top_k: keep the k most likely tokens (0: off). top_p: keep the smallest set of most likely tokens
        whose probability reaches top_p (1.0: off). min_p in [0, 1]: keep tokens whose probability is
        >= min_p x the most likely one's (0.0: off). All three apply after temperature, min_p first (as vLLM).
    repetition_penalty: > 0, CTRL-style on every token seen (prompt and generated); 1.0 is off.
    stop: a tuple of non-empty strings; the text ends before the earliest one that appears.
    seed: an int makes sampling repeatable: the request's random numbers are its own whatever shares the batch
        (its logits too only in fp32, or exactly with tritonq.load(batch_invariant=True): bf16 / fp16 logits can
        change with the batch, within their rounding, and so flip a draw). None draws one.
    min_tokens: EOS and stop strings cannot end the request before this many tokens are generated
        (EOS is masked out of sampling until then); 0 <= min_tokens <= max_new_tokens.
    ignore_eos: EOS does not end the request (it runs to max_new_tokens, a stop string or a stop token).
    stop_token_ids: a tuple of token ids that end the request like EOS (finish reason "stop"; the token
        is kept in token_ids), also masked until min_tokens; not affected by ignore_eos.
    presence_penalty, frequency_penalty in [-2, 2] (OpenAI): each token's logit is lowered by
        frequency_penalty x (times it was generated) + presence_penalty x (1 if it was generated); the
        prompt does not count (as OpenAI and vLLM). 0.0 is off; negative values favour repeats.
    logit_bias: {token id: bias in [-100, 100]} (OpenAI), added to those logits before the penalties,
        temperature and filters (-100 bans a token in practice, 100 all but forces it). Stored as a tuple
        of (token id, bias) pairs sorted by id (a dict or such pairs are accepted).
    top_logprobs: 0..20; also return the log-probabilities of that many most likely tokens at each
        generated position (GenerationOutput.top_logprobs).
    Order in the sampler, as vLLM: min_tokens mask, logit_bias, repetition / frequency / presence
    penalties, the structured-output grammar mask, temperature, min_p, top_k, top_p. Every log-probability
    returned is under the raw logits.
    json_schema / regex / choice / grammar (at most one; tritonq.engine.structured, needs `pip install
        'tritonq[structured]'`): constrain the output to JSON matching a schema (a dict, or its JSON text; stored
        as compact JSON text), to a full match of a regex, to exactly one of a tuple of non-empty strings, or to
        a grammar in xgrammar's EBNF (GBNF: `root ::= ...`, as vLLM's guided_grammar). EOS is
        allowed only where the output is complete; min_tokens and ignore_eos cannot be combined with them
        (the grammar decides where the output ends).
    """
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    min_p: float = 0.0  # the new fields come last: positional construction keeps its meaning
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int = 0
    json_schema: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        check_int("max_new_tokens", self.max_new_tokens, 0)
        check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} > max_new_tokens={self.max_new_tokens}; the request "
                             "would end at max_new_tokens first. Lower min_tokens or raise max_new_tokens.")
        check_int("top_k", self.top_k, 0)
        check_float("temperature", self.temperature, lambda t: t >= 0, ">= 0 (0 means greedy)")
        check_float("top_p", self.top_p, lambda p: 0 < p <= 1, "in (0, 1] (1.0 disables it)")
        check_float("min_p", self.min_p, lambda p: 0 <= p <= 1, "in [0, 1] (0.0 disables it)")
        check_float("repetition_penalty", self.repetition_penalty, lambda p: p > 0, "> 0 (1.0 disables it)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise TypeError(f"seed={self.seed!r} ({type(self.seed).__name__}); expected an int or None.")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos={self.ignore_eos!r} ({type(self.ignore_eos).__name__}); expected True "
                            "or False.")
        if not isinstance(self.stop, tuple):
            raise TypeError(f"stop={self.stop!r} ({type(self.stop).__name__}); expected a tuple of str "
                            "(Model.generate also takes a str or a list).")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty str (an empty one would stop before any text); "
                             f"got stop={self.stop!r}.")
        if not isinstance(self.stop_token_ids, tuple):
            raise TypeError(f"stop_token_ids={self.stop_token_ids!r} ({type(self.stop_token_ids).__name__}); "
                            "expected a tuple of int token ids (Model.generate also takes a list).")
        for t in self.stop_token_ids:
            check_int("stop_token_ids entry", t, 0)
        check_float("presence_penalty", self.presence_penalty, lambda p: -2 <= p <= 2, "in [-2, 2] (0.0 disables it)")
        check_float("frequency_penalty", self.frequency_penalty, lambda p: -2 <= p <= 2,
                     "in [-2, 2] (0.0 disables it)")
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, dict) else bias
        if not isinstance(bias, (dict, tuple)) or not all(isinstance(e, tuple) and len(e) == 2 for e in pairs):
            raise TypeError(f"logit_bias={bias!r}; expected a dict {{token id: bias}} (or a tuple of "
                            "(token id, bias) pairs).")
        for t, b in pairs:
            check_int("logit_bias token id", t, 0)
            check_float(f"logit_bias[{t}]", b, lambda v: -100 <= v <= 100, "in [-100, 100]")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(b)) for t, b in dict(pairs).items())))
        check_int("top_logprobs", self.top_logprobs, 0)
        if self.top_logprobs > MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs={self.top_logprobs}; expected an int in [0, {MAX_TOP_LOGPROBS}].")
        self._check_constraint()
        if 0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)


    def _check_constraint(self) -> None:
        schema = self.json_schema
        if schema is not None:
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"json_schema is not valid JSON ({exc}); pass a dict or its JSON text.") from None
            if not isinstance(schema, dict):
                raise TypeError(f"json_schema={self.json_schema!r:.80} ({type(schema).__name__}); expected a JSON "
                                "schema: a dict (e.g. {'type': 'object'}) or its JSON text.")
            # compact text: hashable, and the grammar cache key. Keys keep their order: properties are
            # generated in the order the schema lists them.
            object.__setattr__(self, "json_schema", json.dumps(schema, separators=(",", ":")))
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            raise TypeError(f"regex={self.regex!r} ({type(self.regex).__name__}); expected a non-empty str.")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar):
            raise TypeError(f"grammar={self.grammar!r} ({type(self.grammar).__name__}); expected a non-empty str "
                            "of EBNF rules (root ::= ...).")
        if self.choice is not None:
            if not isinstance(self.choice, tuple):
                raise TypeError(f"choice={self.choice!r} ({type(self.choice).__name__}); expected a tuple of str "
                                "(Model.generate also takes a list).")
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"choice={self.choice!r}; expected at least one choice, each a non-empty str.")
        given = [n for n in ("json_schema", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} are both set; a request takes one constraint: pass one of them.")
        if given and (self.min_tokens or self.ignore_eos):
            name = "min_tokens" if self.min_tokens else "ignore_eos"
            raise ValueError(f"{name} cannot be combined with {given[0]}: the grammar decides where the output "
                             f"ends (EOS is allowed exactly when it is complete); leave {name} out.")


def option(default, help: str, **cli):
    """An EngineConfig field: its default (written here only) and the help of its command-line option, which
    tritonq.cli generates from the field (cli: flag, choices, metavar, parallel=True for the serve-only ones)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class EngineConfig:
    """The engine and KV-cache options of `tritonq.load` (its docstring says what each does), checked when
    made: the checks that need no file, raised before anything is read. Each field's default is written once,
    here; the commands' options are made from these fields (tritonq.cli.add_load_options). load resolves
    max_seq_len (None: from the model) before the engine gets the config."""
    max_seq_len: int | None = option(None, "prompt + completion tokens per sequence (default: min(the model's "
                                           "positions, 4096))")
    quantize: str | None = option(None, "quantize a dense checkpoint on load (round to nearest)",
                                  choices=QUANTIZE_ON_LOAD)
    group_size: int | None = option(None, "int4 group size for --quantize int4 (default 128; -1: one group per "
                                          "output channel)")
    max_num_seqs: int = option(128, "sequences the engine runs at once")
    max_num_batched_tokens: int = option(2048, "tokens one engine step computes")
    kv_cache_gb: float | None = option(None, "KV cache budget in GiB (default: on CPU 4 at most, on CUDA from "
                                             "--gpu-memory-utilization)")
    gpu_memory_utilization: float = option(0.9, "fraction of the GPU's memory the weights, steps and KV cache "
                                                "may use (CUDA)")
    block_size: int = option(16, "tokens per KV block (a power of two >= 16)")
    kv_cache_dtype: str = option("auto", "KV cache storage (auto: the model dtype; fp8: e4m3, per-tensor scales "
                                         "from the checkpoint or 1.0; int8: per token-head scales); 8-bit holds "
                                         "~2x the tokens", choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompt prefixes earlier requests computed")
    cuda_graphs: bool | None = option(None, "capture decode steps as CUDA graphs (default: on with one CUDA GPU)")
    compile: bool | None = option(None, "torch.compile the CPU decode step per batch bucket (default: off)")
    tensor_parallel: int | None = option(None, "split the model over N processes (torchrun --nproc-per-node N; "
                                               "default: WORLD_SIZE)", parallel=True)
    expert_parallel: bool = option(False, "MoE models under tensor parallelism: whole routed experts per rank "
                                          "(E/N each) instead of every expert split by its intermediate size",
                                   parallel=True)
    speculative: SpeculativeConfig | None = option(  # a dict or JSON text is parsed (SpeculativeConfig.parse)
        None, 'speculative decoding, e.g. \'{"method": "ngram", "num_tokens": 4}\' or \'{"method": "draft", '
              '"model": "PATH_OR_ID", "num_tokens": 4}\' (see tritonq.load)', flag="--speculative-config",
        metavar="JSON")
    batch_invariant: bool = option(False, "each sequence's tokens independent of what else is in its batch, in "
                                          "bf16 / fp16 too (fixed reduction orders; slower: "
                                          "docs/batch_invariance.md)")

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}; expected one of {KV_CACHE_DTYPES} (auto: the "
                             "model dtype; fp8: e4m3 with per-tensor scales; int8: per token-head scales).")
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len < 1):
            raise ValueError(f"max_seq_len={self.max_seq_len!r}; expected a positive int (tokens of one request: "
                             "prompt + max_new_tokens), or None for min(max_position_embeddings, 4096).")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs!r}; expected a positive int (sequences run at once).")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens!r}; expected an int >= "
                             f"max_num_seqs={self.max_num_seqs} (tokens one step computes; a decode step has one "
                             "per sequence).")
        if self.kv_cache_gb is not None and not (isinstance(self.kv_cache_gb, (int, float)) and self.kv_cache_gb > 0):
            raise ValueError(f"kv_cache_gb={self.kv_cache_gb!r}; expected a positive number of GiB, or None for the "
                             "default.")
        utilization = self.gpu_memory_utilization
        if not (isinstance(utilization, (int, float)) and 0 < utilization <= 1):
            raise ValueError(f"gpu_memory_utilization={utilization!r}; expected a fraction in (0, 1].")
        block = self.block_size
        if not isinstance(block, int) or block < 16 or block & (block - 1):
            raise ValueError(f"block_size={block!r}; expected a power of two >= 16 (16, 32, 64, ...).")
        if self.group_size is not None and self.quantize != "int4":
            raise ValueError(f"group_size={self.group_size} applies to quantize='int4' only; got "
                             f"quantize={self.quantize!r}.")
        if self.group_size is not None and (not isinstance(self.group_size, int)
                                            or not (self.group_size > 0 or self.group_size == -1)):
            raise ValueError(f"group_size={self.group_size!r}; expected a positive number of input rows per group "
                             "(e.g. 32, 64, 128) or -1 for one group per output channel.")
        if self.cuda_graphs not in (None, True, False):
            raise ValueError(f"cuda_graphs={self.cuda_graphs!r}; expected True, False or None (True on CUDA).")
        if self.compile not in (None, True, False):
            raise ValueError(f"compile={self.compile!r}; expected True, False or None (the CPU default, off).")
        if self.expert_parallel not in (True, False):
            raise ValueError(f"expert_parallel={self.expert_parallel!r}; expected True or False")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant={self.batch_invariant!r}; expected True or False.")
        if self.batch_invariant and self.compile:
            raise ValueError("batch_invariant=True with compile=True: the compiled decode step runs torch's own GEMMs, "
                             "whose summation order changes with the batch; leave compile unset.")
        object.__setattr__(self, "speculative", SpeculativeConfig.parse(self.speculative))


SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """method "ngram" (prompt lookup: the continuation of the latest earlier match of the last n tokens,
    n from max_n down to min_n) or "draft" (model: a smaller model with the same tokenizer, run greedily k
    tokens ahead over its own paged cache); num_tokens: k, the most tokens proposed per sequence and step."""
    method: str
    num_tokens: int
    min_n: int = 1
    max_n: int = 4
    model: str | None = None

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """From a dict, a JSON object string (the server's --speculative-config), a SpeculativeConfig or
        None; ValueError / TypeError naming the bad key or value."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config {value!r} is not valid JSON ({e}); expected e.g. "
                                 '\'{"method": "ngram", "num_tokens": 4}\'.') from e
        if not isinstance(value, dict):
            raise TypeError(f"speculative={value!r} ({type(value).__name__}); expected a dict such as "
                            '{"method": "ngram", "num_tokens": 4} or {"method": "draft", "model": PATH, '
                            '"num_tokens": 4}.')
        unknown = set(value) - {"method", "num_tokens", "min_n", "max_n", "model"}
        if unknown:
            raise ValueError(f"speculative config has unknown keys {sorted(unknown)}; expected method, "
                             "num_tokens, and min_n / max_n (ngram) or model (draft).")
        method = value.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method is {method!r}; expected one of {SPECULATIVE_METHODS}.")
        for key in ("num_tokens", "min_n", "max_n"):
            v = value.get(key, 1)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative {key}={v!r}; expected an int >= 1.")
        if "num_tokens" not in value:
            raise ValueError("the speculative config needs num_tokens (the most tokens proposed per step), e.g. 4.")
        config = cls(method, value["num_tokens"], value.get("min_n", 1), value.get("max_n", 4), value.get("model"))
        if config.min_n > config.max_n:
            raise ValueError(f"speculative min_n={config.min_n} > max_n={config.max_n}; expected min_n <= max_n.")
        if method == "draft" and not (isinstance(config.model, str) and config.model):
            raise ValueError('speculative method "draft" needs "model": a folder or Hugging Face id of a smaller '
                             "model with the target's tokenizer.")
        if method == "ngram" and config.model is not None:
            raise ValueError('speculative method "ngram" takes no "model" (did you mean method "draft"?).')
        return config
