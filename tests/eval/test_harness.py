"""The `tritonq` lm_eval model against lm_eval's own `hf` model on the same tiny float32 checkpoint.

Three local YAML tasks over JSON files written to tmp (no network: both HF offline switches are on):
multiple choice (loglikelihood, one question with an empty context so the prefix-token path runs),
loglikelihood_rolling over texts longer than max_length (several windows), and greedy generate_until
with a stop string. Per sample, the loglikelihoods agree to float32 rounding (atol 1e-4 on sums of a
few dozen logprobs, each good to ~1e-5), the is-greedy flags and the generated strings are equal.
"""
import json
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")

import tritonq  # noqa: E402
from tritonq.eval.__main__ import main  # noqa: E402

from test_score import POSITIONS, write_checkpoint  # noqa: E402

ATOL = 1e-4
pytestmark = pytest.mark.usefixtures("one_thread", "offline")


@pytest.fixture
def offline(monkeypatch):
    """Nothing may reach the network: datasets and huggingface_hub read these switches when first imported,
    so set the environment for a first import and the modules' flags for an earlier one."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    import datasets
    import huggingface_hub
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setattr(datasets.config, name, True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

QUESTIONS = [  # the answers are arbitrary: accuracy is not the point, per-choice loglikelihoods are
    {"question": "Who wrote Hamlet?", "choices": ["Shakespeare", "Marlowe", "a monkey"], "answer": 0},
    {"question": "To be, or not to", "choices": [" be", " bee", " sea", "be"], "answer": 0},
    {"question": "", "choices": ["Alas, poor Yorick", "x"], "answer": 1},
]
TEXTS = [{"text": "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him. "
                  "The evil that men do lives after them; the good is oft interred with their bones."},
         {"text": "Out, out, brief candle!"}]
PROMPTS = [{"question": "Q: What is 2+2?\nA:", "answer": " 4"}, {"question": "Once upon a time", "answer": "x"},
           {"question": "", "answer": ""}]


def write_tasks(folder):
    folder.mkdir()
    tasks = {"tiny_mc": (QUESTIONS, {"output_type": "multiple_choice", "doc_to_text": "{{question}}",
                                     "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
                                     "metric_list": [{"metric": "acc"}]}),
             "tiny_rolling": (TEXTS, {"output_type": "loglikelihood_rolling", "doc_to_text": "",
                                      "doc_to_target": "{{text}}", "metric_list": [{"metric": "word_perplexity"}]}),
             "tiny_generate": (PROMPTS, {"output_type": "generate_until", "doc_to_text": "{{question}}",
                                         "doc_to_target": "{{answer}}", "metric_list": [{"metric": "exact_match"}],
                                         "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": 12,
                                                               "do_sample": False}})}
    for name, (rows, options) in tasks.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                  "test_split": "test", **options}
        (folder / f"{name}.yaml").write_text(json.dumps(config))  # JSON is YAML
    return list(tasks)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    write_checkpoint(root / "model")
    return root / "model", root / "tasks", write_tasks(root / "tasks")


def evaluate(lm, task_folder, tasks):
    from lm_eval.tasks import TaskManager
    manager = TaskManager(include_path=str(task_folder), include_defaults=False)
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, log_samples=True, bootstrap_iters=0)
    return {task: sorted(samples, key=lambda s: s["doc_id"]) for task, samples in out["samples"].items()}


def test_matches_lm_eval_hf_model(setup, monkeypatch):
    from lm_eval.models.huggingface import HFLM

    from tritonq.eval.harness import TritonQLM
    folder, task_folder, tasks = setup
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    ours = evaluate(TritonQLM(model=tritonq.load(folder, max_seq_len=POSITIONS, max_num_seqs=8,
                                                   max_num_batched_tokens=32)),
                    task_folder, tasks)
    theirs = evaluate(HFLM(pretrained=str(folder), dtype="float32", device="cpu", batch_size=1), task_folder, tasks)
    assert [len(ours[t]) for t in tasks] == [len(theirs[t]) for t in tasks] == [3, 2, 3]
    assert len(tritonq.load(folder).tokenizer(TEXTS[0]["text"]).input_ids) > 2 * POSITIONS  # 3 rolling windows
    for task in tasks:
        for mine, ref in zip(ours[task], theirs[task]):
            assert mine["arguments"] == ref["arguments"]  # the same requests
            if task == "tiny_generate":
                assert mine["resps"] == ref["resps"]
                continue
            got = [r[0] for r in mine["resps"]]
            expected = [r[0] for r in ref["resps"]]
            if task == "tiny_mc":
                assert [g for _, g in got] == [g for _, g in expected]  # is-greedy flags
                got, expected = [ll for ll, _ in got], [ll for ll, _ in expected]
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                                       torch.tensor(expected, dtype=torch.float64), atol=ATOL, rtol=0)


def test_registered_under_tritonq_and_cli_runs_a_task(setup, capsys, monkeypatch):
    from lm_eval.api.registry import get_model

    from tritonq.eval.harness import TritonQLM
    folder, task_folder, _ = setup
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    assert get_model("tritonq") is TritonQLM
    lm = TritonQLM.create_from_arg_string(f"pretrained={folder},dtype=float32,max_seq_len={POSITIONS}",
                                          {"batch_size": 4, "device": "cpu"})
    assert lm.max_length == POSITIONS
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # docs/cli.md's command: the repo's example task
    main(["lm_eval", "--model-path", str(folder), "--tasks", "shakespeare_next_word", "--include-path",
          "tests/data/lm_eval", "--max-seq-len", str(POSITIONS), "--output-path", str(task_folder / "out.json")])
    assert "|shakespeare_next_word|" in capsys.readouterr().out
    assert json.loads((task_folder / "out.json").read_text())["results"]["shakespeare_next_word"]["acc,none"] >= 0
    for argv, phrase in [(["--tasks", " , "], "names no task"),
                         (["--tasks", "tiny_mc", "--log-samples"], "give --output-path")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["lm_eval", "--model-path", str(folder), *argv])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and phrase in err.splitlines()[-1], err
