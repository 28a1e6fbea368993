"""Conformance with a client nobody here wrote: EleutherAI's lm-evaluation-harness (``lm-eval``,
its ``local-completions`` model, the command of README.md "Talking to a checkpoint") against the
server, on two tasks defined in local YAML + JSONL files and the run's own tokenizer folder —
nothing downloaded.

* a multiple-choice task, scored by log-likelihood: lm-eval sends token-id prompts with
  ``echo: true, logprobs: 1`` and sums the prompt log-probs of each answer's tokens. Those sums
  equal the model's in-process log-probs of the same tokens to 1e-5, and lm-eval's accuracy
  equals the accuracy computed directly from them;
* a generation task (``generate_until``, greedy): each answer equals the model's own greedy
  continuation cut at the stop string, and lm-eval's exact match equals the direct count.

The answer keys are built from the in-process model so that half of each task is right: an
accuracy of 0.5 exercises both the right and the wrong branch of lm-eval's scoring.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.serve.conftest import start_server

pytestmark = pytest.mark.slow

QUESTIONS = [
    ("The cat sat on the", ["mat", "moon", "river", "idea"]),
    ("Two plus two equals", ["four", "five", "seven", "blue"]),
    ("The sky is", ["blue", "loud", "square", "late"]),
    ("Water is", ["wet", "dry", "angry", "fast"]),
    ("The sun rises in the", ["east", "west", "soup", "box"]),
    ("A dog says", ["woof", "meow", "moo", "quack"]),
]
PROMPTS = ["Q: What is the capital of France?\nA:", "Once upon a time", "1, 2, 3,", "Hello, my name is",
           "The quick brown fox", "def add(a, b):"]
UNTIL = ["\n"]
MAX_GEN_TOKS = 6

MC_TASK = """task: s2_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
GEN_TASK = """task: s2_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: {until}
  max_gen_toks: {max_gen_toks}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


@pytest.fixture(scope="module")
def harness_tokenizer(run_dir):
    """lm-eval's own tokenisation (its ``_encode_pair`` / ``tok_encode`` over the run's tokenizer
    folder), so the in-process reference scores exactly the token ids lm-eval sends."""
    pytest.importorskip("lm_eval", reason="lm-eval is in the dev extras: pip install -e '.[dev]'")
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return LocalCompletionsAPI(base_url="http://127.0.0.1:9/v1/completions", model="tiny",
                               tokenizer=str(run_dir / "tokenizer"), tokenizer_backend="huggingface",
                               tokenized_requests=True)


def loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    """Sum of the model's log-probs of ``continuation`` after ``context`` (one forward, fp32)."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([context + continuation]))[0].float(), -1)
    return sum(float(logp[len(context) - 1 + i, token]) for i, token in enumerate(continuation))


def greedy_text(model, tokenizer, context: list[int], eos: int) -> str:
    """The model's greedy continuation of ``context`` as lm-eval receives it (cut at UNTIL)."""
    ids: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_GEN_TOKS):
            token = int(model(torch.tensor([context + ids]))[0, -1].argmax())
            ids.append(token)
            if token == eos:
                break
    text = tokenizer.decode(ids)
    for stop in UNTIL:
        text = text.split(stop)[0]
    return text


def write_tasks(folder: Path, model, tokenizer, harness) -> None:
    """The two tasks, answer keys chosen so that the model gets exactly half of each right."""
    rows = []
    for index, (question, choices) in enumerate(QUESTIONS):
        scores = [loglikelihood(model, *harness._encode_pair(question, f" {choice}")) for choice in choices]
        best = max(range(len(choices)), key=scores.__getitem__)
        rows.append({"question": question, "choices": choices,
                     "answer": best if index % 2 == 0 else (best + 1) % len(choices)})
    (folder / "mc.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    rows = []
    for index, prompt in enumerate(PROMPTS):
        text = greedy_text(model, tokenizer, harness.tok_encode(prompt), tokenizer.eos_id)
        rows.append({"prompt": prompt, "answer": text if index % 2 == 0 else text + " (not this)"})
    (folder / "gen.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "s2_tiny_mc.yaml").write_text(MC_TASK.format(data=folder / "mc.jsonl"))
    (folder / "s2_tiny_gen.yaml").write_text(GEN_TASK.format(data=folder / "gen.jsonl", until=json.dumps(UNTIL),
                                                             max_gen_toks=MAX_GEN_TOKS))


def run_lm_eval(url: str, tokenizer_dir: Path, tasks: Path, out: Path) -> subprocess.CompletedProcess:
    """README.md's command (plus --output_path / --log_samples to read what lm-eval received)."""
    model_args = (f"model=tiny,base_url={url}/v1/completions,tokenizer={tokenizer_dir},"
                  "tokenizer_backend=huggingface,tokenized_requests=True,max_length=256,num_concurrent=1,"
                  "max_retries=1")
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
               "--include_path", str(tasks), "--tasks", "s2_tiny_mc,s2_tiny_gen", "--batch_size", "4",
               "--output_path", str(out), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost",
           "no_proxy": "127.0.0.1,localhost", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)


def read_output(out: Path) -> tuple[dict, dict[str, list[dict]]]:
    """(the results per task, the logged samples per task) that lm-eval wrote under ``out``."""
    (results_file,) = out.rglob("results_*.json")
    samples = {}
    for path in out.rglob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(results_file.read_text())["results"], samples


def test_lm_eval_local_completions_scores_what_the_model_computes(loaded, run_dir, harness_tokenizer, tmp_path):
    model, tokenizer, _ = loaded
    tasks, out = tmp_path / "tasks", tmp_path / "out"
    tasks.mkdir()
    write_tasks(tasks, model, tokenizer, harness_tokenizer)
    srv = start_server(loaded)
    try:
        proc = run_lm_eval(srv.url, run_dir / "tokenizer", tasks, out)
    finally:
        srv.stop()
    assert proc.returncode == 0, proc.stderr[-4000:]
    results, samples = read_output(out)

    # log-likelihoods: what lm-eval received equals the model's own, token for token
    correct = []
    for sample in samples["s2_tiny_mc"]:
        received = [float(resp[0][0]) for resp in sample["resps"]]
        expected = [loglikelihood(model, *harness_tokenizer._encode_pair(args["arg_0"], args["arg_1"]))
                    for args in sample["arguments"].values()]
        assert len(received) == len(expected) == 4
        assert max(abs(a - b) for a, b in zip(received, expected)) <= 1e-5, (received, expected)
        correct.append(max(range(4), key=expected.__getitem__) == sample["doc"]["answer"])
    assert len(correct) == len(QUESTIONS)
    assert results["s2_tiny_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct)) == 0.5

    # generation: lm-eval's answers are the model's greedy continuations
    matches = []
    for sample in samples["s2_tiny_gen"]:
        answer = sample["resps"][0][0]
        context = harness_tokenizer.tok_encode(sample["arguments"]["gen_args_0"]["arg_0"])
        assert answer == greedy_text(model, tokenizer, context, tokenizer.eos_id), sample
        matches.append(answer == sample["doc"]["answer"])
    assert len(matches) == len(PROMPTS)
    assert results["s2_tiny_gen"]["exact_match,none"] == pytest.approx(sum(matches) / len(matches)) == 0.5
