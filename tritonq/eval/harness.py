"""The `tritonq` model of EleutherAI's lm-evaluation-harness (pip install "tritonq[eval]").

Importing this module registers the model under the name "tritonq" in lm_eval's registry:

    import tritonq.eval.harness  # noqa: F401  (registers "tritonq")
    import lm_eval
    lm_eval.simple_evaluate(model="tritonq", model_args="pretrained=PATH,dtype=float32", tasks=["hellaswag"])

lm_eval's own `lm_eval` command does not import third-party packages (0.4.x has no plugin entry point), so
from a shell use `python -m tritonq.eval lm_eval --model-path PATH --tasks hellaswag`, which imports this
module and calls lm_eval.simple_evaluate.

Requests follow lm_eval's `hf` model so the numbers compare: the same tokenization (TemplateLM's
context/continuation split, BOS handling, the prefix token for an empty context), the same left
truncation to max_length (+1 for loglikelihood), the same rolling windows for loglikelihood_rolling, and
for generate_until the same stop strings (the task's `until` plus EOS) cut from the decoded text. All
requests of a call go to the engine at once (Model.score / Model.generate batch them), so `batch_size`
is accepted and ignored.
"""
from __future__ import annotations

import json
import logging

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

import tritonq

log = logging.getLogger(__name__)

# generation kwargs of lm_eval tasks that map onto GenerationConfig fields
_SAMPLING_KWARGS = ("top_k", "top_p", "repetition_penalty", "seed")


@register_model("tritonq")
class TritonQLM(TemplateLM):
    """lm_eval model over a tritonq.Model.

    pretrained: a checkpoint folder or hub id, loaded with tritonq.load and the load options given
    (dtype "auto" or a name, device, quantize, group_size, revision, max_seq_len, max_num_seqs,
    max_num_batched_tokens, kv_cache_gb); or model=an already loaded tritonq.Model.
    add_bos_token: None follows the tokenizer (as `hf` does), True/False forces it. max_gen_toks: the
    generation budget when a task sets none (256, as `hf`). max_length is the model's max_seq_len.
    """

    def __init__(self, pretrained: str | None = None, *, model: tritonq.Model | None = None, dtype: str | None = None,
                 device: str | None = None, quantize: str | None = None, group_size: int | None = None,
                 revision: str | None = None, max_seq_len: int | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, kv_cache_gb: float | None = None,
                 add_bos_token: bool | None = None, max_gen_toks: int = 256, batch_size=None, max_batch_size=None,
                 **unknown):
        super().__init__()
        if unknown:
            raise ValueError(f"model_args {sorted(unknown)} are not options of the tritonq model; it takes pretrained, "
                             "dtype, device, quantize, group_size, revision, max_seq_len, max_num_seqs, "
                             "max_num_batched_tokens, kv_cache_gb, add_bos_token, max_gen_toks.")
        if (pretrained is None) == (model is None):
            raise ValueError("give the tritonq model either pretrained=PATH_OR_HUB_ID or model=a loaded tritonq.Model "
                             f"(got pretrained={pretrained!r}, model={type(model).__name__}).")
        if model is None:
            engine = dict(quantize=quantize, group_size=group_size, max_seq_len=max_seq_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, kv_cache_gb=kv_cache_gb)
            model = tritonq.load(pretrained, dtype=None if dtype in (None, "auto") else dtype, device=device,
                                 revision=revision, **{k: v for k, v in engine.items() if v is not None})  # None: load's default
        self.model, self.tokenizer = model, model.tokenizer
        self.add_bos_token, self._max_gen_toks = add_bos_token, max_gen_toks

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is conditioned on: BOS, else EOS (as `hf`)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.model.max_seq_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """Token ids of string. add_special_tokens None: add_bos_token if set, else the tokenizer's default,
        and never a second BOS when the text already starts with the prefix token's text."""
        if add_special_tokens is None:
            add_special_tokens = True if self.add_bos_token is None else self.add_bos_token
            if string.startswith(self.tokenizer.decode([self.prefix_token_id])):
                add_special_tokens = False
        ids = self.tokenizer.encode(string, add_special_tokens=add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) or None, context ids, continuation ids) -> (sum of the
        continuation's logprobs, whether every continuation token is the greedy choice), in order."""
        sequences = []
        for (_, context, continuation) in requests:
            if not context or not continuation:
                raise ValueError(f"a loglikelihood request needs context and continuation tokens; got "
                                 f"{len(context)} and {len(continuation)}.")
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens exceeds max_length={self.max_length};"
                                 " load with a larger max_seq_len.")
            whole = context + continuation
            if len(whole) > self.max_length + 1:  # the last token is only a target: max_length inputs
                log.warning("context (%d) + continuation (%d) tokens exceed max_length %d + 1: dropping the first %d "
                            "context tokens.", len(context), len(continuation), self.max_length,
                            len(whole) - self.max_length - 1)
            sequences.append(whole[-(self.max_length + 1):])
        scored = self.model._score_ids(sequences, not disable_tqdm, "Running loglikelihood requests", "request")
        answers = []
        for (key, _, continuation), (logprobs, greedy, _) in zip(requests, scored):
            n = len(continuation)
            answer = (float(logprobs[-n:].sum()), bool(greedy[-n:].all()))
            answers.append(answer)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts over disjoint windows of max_length tokens (lm_eval's rolling
        windows, the first conditioned on the prefix token), summed per text."""
        windows, owners = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(string)
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, do_sample=True) continuations cut at the task's stop strings and EOS; requests
        with the same generation kwargs run as one batch of the engine."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        results: list[str | None] = [None] * len(requests)
        for indices in groups.values():
            kwargs = dict(normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            do_sample, temperature = kwargs.pop("do_sample", False), float(kwargs.pop("temperature", 0.0))
            temperature = temperature if do_sample else 0.0  # normalize_gen_kwargs: do_sample=False is greedy
            options = {k: kwargs.pop(k) for k in _SAMPLING_KWARGS if k in kwargs}
            if kwargs:
                log.warning("tritonq ignores generation kwargs %s", sorted(kwargs))
            max_context = self.max_length - max_gen_toks
            if max_context < 1:
                raise ValueError(f"max_gen_toks={max_gen_toks} leaves no room for a prompt in max_length="
                                 f"{self.max_length}; load with a larger max_seq_len or lower max_gen_toks.")
            prompts = [self._encode_context(requests[i].args[0], max_context) for i in indices]
            texts = self.model.generate(prompts, max_new_tokens=max_gen_toks, temperature=temperature,
                                        stop=[s for s in until if s], progress=not disable_tqdm, **options)
            for i, text in zip(indices, texts):
                results[i] = postprocess_generated_text(text, until, None)
                self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
        return results

    def _encode_context(self, string: str, max_context: int) -> list[int]:
        """A generation prompt as `hf` encodes it: BOS per add_bos_token / the tokenizer unless the text
        starts with the BOS text, then the last max_context tokens."""
        add = True if self.add_bos_token is None else self.add_bos_token
        bos = self.tokenizer.bos_token
        if bos is not None and string.startswith(bos):
            add = False
        return self.tokenizer.encode(string, add_special_tokens=add)[-max_context:]
