"""`python tests/serve/serve_scripted.py MODEL ARGS...`: `python -m tritonq.serve` whose sampler writes a given reply,
for tests of what the server does with given model output (tests/serve/test_serve_tool_reader.py).

TRITONQ_TEST_SCRIPT_FILE names a file holding a JSON list of token ids. Every sampled row takes the id at its
position among the generated tokens (the last id once past the end); logprob 0, no top logprobs. The int-digit
limit is lowered to Python's minimum (640) so a reply past it stays short.
"""
import json
import os
import sys

from tritonq.engine.sampler import Sampler

SCRIPT_FILE = os.environ["TRITONQ_TEST_SCRIPT_FILE"]


def _sample(self, logits, params, token_ids, mask_eos=None, eos_token_ids=frozenset(), token_bitmask=None):
    with open(SCRIPT_FILE) as f:
        script = json.load(f)
    tokens = [script[min(len(ids) - p.num_prompt_tokens, len(script) - 1)] for p, ids in zip(params, token_ids)]
    return tokens, [0.0] * len(tokens), [None] * len(tokens)


Sampler.sample = _sample
sys.set_int_max_str_digits(640)

if __name__ == "__main__":
    from tritonq.serve.__main__ import main
    main(sys.argv[1:])
