"""`torchrun ... -m tritonq.serve` on 2 CPU ranks (gloo), checked with the openai client against one process.

The two ranks are two torchrun "nodes" of one process each, joined through torchrun's c10d rendezvous
(--nnodes 2 --rdzv-endpoint), as two machines would be: the same code path as --nproc-per-node 2 on one
machine, plus the rendezvous. Either node may get rank 0; both are told the same port and only rank 0 binds
it. The model is the server tests' tiny Llama on the torch backend in float32; the reference is
Model.generate in this process. Tensor parallelism regroups float32 sums only (tests/parallel/test_tensor_parallel.py:
logits within 1e-4), so texts are compared exactly after checking no greedy token was a near tie.
"""
import os
import signal
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import serve_util  # noqa: E402
import tolerances  # noqa: E402
from serve_util import MAX_SEQ_LEN, MODEL_NAME, ROOT, Server  # noqa: E402


@pytest.fixture(scope="module")
def two_node_server(checkpoint, tmp_path_factory):
    """The server on two torchrun nodes; yields (Server of node A, node B's process)."""
    logs = tmp_path_factory.mktemp("tp_serve")
    port, rendezvous = serve_util._free_port(), f"127.0.0.1:{serve_util._free_port()}"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", rendezvous, "--rdzv-id", "tritonq-test"]
    serve = ["-m", "tritonq.serve"]
    args = ("--max-num-seqs", "4")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITONQ_BACKEND="torch", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    node_b = subprocess.Popen([*torchrun, *serve, str(checkpoint), "--port", str(port), "--served-model-name",
                               MODEL_NAME, "--max-seq-len", str(MAX_SEQ_LEN), "--log-level", "warning", "--dtype",
                               "float32", *args], env=env, stdout=(logs / "node_b.log").open("w"),
                              stderr=subprocess.STDOUT)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serve_util, "_free_port", lambda: port)  # node A's Server waits on the same port
        try:
            server = Server(checkpoint, logs / "node_a.log", *args, entry=[*torchrun[1:], *serve],
                            env={"OMP_NUM_THREADS": "1"})
        except BaseException:
            node_b.kill()
            print((logs / "node_b.log").read_text()[-3000:])
            raise
    yield server, node_b
    for proc in (server.proc, node_b):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in (server.proc, node_b):
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_two_rank_server_answers_like_one_process(two_node_server, reference):
    server, node_b = two_node_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)
    prompts = ["Hello, tritonq!", "two ranks"]
    for prompt in prompts:  # one request at a time, then both at once (one batch across the ranks)
        expected = reference.generate(prompt, max_new_tokens=12, temperature=0, return_dict=True)
        ids = reference.tokenizer(prompt).input_ids
        assert tolerances.first_near_tie(reference, ids, expected.token_ids[0]) == len(expected.token_ids[0])
        reply = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
        assert reply.choices[0].text == expected.text[0]
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text[0]
    batch = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=12, temperature=0)
    expected = reference.generate(prompts, max_new_tokens=12, temperature=0, return_dict=True)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == expected.text
    assert node_b.poll() is None  # the other rank is still stepping with rank 0


def test_followers_replay_exactly_what_rank_0_forwarded(checkpoint, monkeypatch):
    """In one process, with the broadcast recorded: LeaderEngine forwards its successful adds, aborts, steps and
    scores in order (a refused add is not forwarded), and a second engine replaying the record through
    follow() numbers the requests alike and produces the same outputs, step by step."""
    import torch

    import tritonq
    from tritonq.api.model import GenerationConfig
    from tritonq.serve import ranks

    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    leader_model, follower_model = (tritonq.load(checkpoint, max_seq_len=64, max_num_seqs=4, dtype=torch.float32,
                                                 device="cpu") for _ in range(2))
    sent = []
    monkeypatch.setattr(ranks.dist, "broadcast_object_list", lambda box, src, group: sent.append(box[0]))
    leader = ranks.LeaderEngine(leader_model.engine, group=None)
    config = GenerationConfig(max_new_tokens=6, temperature=0)
    first = leader.add_request([5, 6, 7], config)
    with pytest.raises(ValueError):
        leader.add_request([10 ** 6], config)  # not a token id: refused on rank 0, never forwarded
    second = leader.add_request([8, 9], config)
    expected = [leader.step() for _ in range(3)]
    leader.abort(first)
    while leader.has_unfinished():
        expected.append(leader.step())
    expected_scores = leader.score([[65, 66, 67, 68]])
    leader.close()
    assert [[c[0] for c in calls if c] for calls in sent][:2] == [["add_request", "add_request", "step"], ["step"]]

    replayed, record = [], iter(sent)

    def receive(box, src, group):
        box[0] = next(record)
    monkeypatch.setattr(ranks.dist, "broadcast_object_list", receive)
    engine = follower_model.engine
    step, score, scoring = engine.step, engine.score, []

    def recorded_step():  # the steps follow() replays; score() steps the engine itself (its result is recorded)
        outs = step()
        if not scoring:
            replayed.append(outs)
        return outs

    def recorded_score(*args, **kwargs):
        scoring.append(True)
        try:
            replayed.append(score(*args, **kwargs))
        finally:
            scoring.pop()
        return replayed[-1]
    monkeypatch.setattr(engine, "step", recorded_step)
    monkeypatch.setattr(engine, "score", recorded_score)
    ranks.follow(engine, group=None)
    assert next(record, None) is None and not engine.has_unfinished()
    scores = replayed.pop()
    assert [[(o.request_id, o.token_id, o.finished) for o in outs] for outs in replayed] == \
        [[(o.request_id, o.token_id, o.finished) for o in outs] for outs in expected]
    assert {o.request_id for outs in expected for o in outs} == {first, second}
    for (got, *_), (want, *_) in zip(scores, expected_scores, strict=True):
        assert torch.equal(got, want)
