"""One engine of `python -m tritonq.bench vs-vllm`, in its own process: tritonq or vLLM.

    python -P _vs_vllm_worker.py {tritonq|vllm} SPEC_JSON

Standard library only at the top: the vLLM worker runs under the python of vLLM's own venv, which
has no tritonq (and -P keeps this folder, whose bench modules are named like common packages, off
sys.path). SPEC_JSON: {"model", "dtype", "max_num_seqs", "max_model_len"}. The engine is loaded
and warmed up, then the worker answers one JSON line per command line read from stdin:
  {"op": "generate", "prompts": [[ids]], "max_tokens": N} -> {"seconds": wall s, "tokens": [[ids]]}
greedy, EOS ignored, every prompt queued at once; {"op": "quit"} ends it. Answers go to the
original stdout; the worker's own stdout (vLLM logs there) is sent to stderr.
"""
import json
import os
import sys
import time


def tritonq_engine(spec: dict):
    """generate(prompts, max_tokens) -> generated ids per prompt, through tritonq's engine."""
    import tritonq
    from tritonq.api.model import GenerationConfig
    model = tritonq.load(spec["model"], dtype=spec["dtype"], device="cpu", max_num_seqs=spec["max_num_seqs"],
                         max_seq_len=spec["max_model_len"])
    engine = model.engine

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        config = GenerationConfig(max_new_tokens=max_tokens, ignore_eos=True)
        ids = [engine.add_request(p, config, stream=False) for p in prompts]
        tokens = {rid: [] for rid in ids}
        while engine.has_unfinished():
            for out in engine.step():
                if out.error:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                if out.token_id is not None:
                    tokens[out.request_id].append(out.token_id)
        return [tokens[rid] for rid in ids]
    return generate


def vllm_engine(spec: dict):
    """generate(prompts, max_tokens) -> generated ids per prompt, through vLLM's offline LLM."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"], seed=0)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    return generate


def main() -> None:
    which, spec = sys.argv[1], json.loads(sys.argv[2])
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # logs written to stdout (vLLM's, its engine core's) go to stderr, not into the answers
    start = time.perf_counter()
    generate = {"tritonq": tritonq_engine, "vllm": vllm_engine}[which](spec)
    generate([list(range(1, 65))], 2)  # warm-up: a 64-token prefill compiles tritonq's int4 GEMM templates (M > 8)
    answers.write(json.dumps({"ready": True, "load_s": time.perf_counter() - start}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        start = time.perf_counter()
        tokens = generate(command["prompts"], command["max_tokens"])
        answers.write(json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens}) + "\n")


if __name__ == "__main__":  # vLLM starts its engine core with spawn: this module is imported again there
    main()
