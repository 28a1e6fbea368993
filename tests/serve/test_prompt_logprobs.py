"""vLLM's ``prompt_logprobs`` on ``/inference/v1/generate`` and ``/v1/completions``: the response
layout (first position null, the actual token plus k alternatives, 1-based ranks), values equal
to an in-process OPD teacher's log-probs of the same tokens loaded from the same checkpoint
(fp32), the server-side ``prompt_logprobs_temperature``, and refusals naming the field."""

from __future__ import annotations

import httpx
import pytest
import torch

from megatron_s2.config.schema import ConfigError
from megatron_s2.posttrain.frozen import TeacherPool, load_frozen_model
from megatron_s2.serve import ServeConfig
from tests.serve.conftest import start_server

SEQUENCES = [[0, 30, 31, 32, 33, 34, 35, 36, 40, 41], [0, 50, 7, 7, 9], [0, 90, 91]]


@pytest.fixture(scope="module")
def server(loaded):
    srv = start_server(loaded, serve=ServeConfig(disconnect_poll_s=0.05, max_logprobs=5))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def in_process(run_dir, loaded):
    """The checkpoint loaded a second time as the trainer loads an in-process teacher."""
    model, tokenizer, _ = loaded
    teacher = load_frozen_model(run_dir, model.groups, vocab_size=model.config.vocab_size, tokenizer=tokenizer,
                                what="teacher", device="cpu")
    return teacher, model.groups


def in_process_logprobs(in_process, temperature=1.0) -> list[torch.Tensor]:
    """log pi_T of every label of the right-padded batch of SEQUENCES (the trainer's layout)."""
    teacher, groups = in_process
    pool = TeacherPool({"t": teacher}, {"d": "t"}, {"t": temperature})
    s = max(map(len, SEQUENCES)) - 1
    tokens, labels = torch.zeros(len(SEQUENCES), s, dtype=torch.long), torch.zeros(len(SEQUENCES), s, dtype=torch.long)
    for i, ids in enumerate(SEQUENCES):
        tokens[i, :len(ids) - 1], labels[i, :len(ids) - 1] = torch.tensor(ids[:-1]), torch.tensor(ids[1:])
    lp = pool.token_logprobs(tokens, labels, ["d"] * len(SEQUENCES), groups.tp)
    return [lp[i, :len(ids) - 1] for i, ids in enumerate(SEQUENCES)]


def post(server, path, body, status=200):
    r = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def actual(entries, ids) -> torch.Tensor:
    return torch.tensor([entries[p][str(ids[p])]["logprob"] for p in range(1, len(ids))])


def test_token_endpoint_prompt_logprobs_equal_the_in_process_teacher(server, in_process):
    ref = in_process_logprobs(in_process)
    for ids, expected in zip(SEQUENCES, ref):
        out = post(server, "/inference/v1/generate",
                   {"token_ids": ids, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0}})
        entries = out["prompt_logprobs"]
        assert len(entries) == len(ids) and entries[0] is None
        assert all(list(e) == [str(t)] for e, t in zip(entries[1:], ids[1:]))  # k = 0: the actual token only
        assert set(entries[1][str(ids[1])]) == {"logprob", "rank", "decoded_token"}
        got = actual(entries, ids)
        assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
        assert len(out["choices"][0]["token_ids"]) == 1


def test_completions_top_k_ranks_and_temperature(server, in_process, loaded):
    model, _, _ = loaded
    ids = SEQUENCES[0]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0, :-1].float(), -1)
    out = post(server, "/v1/completions", {"model": "tiny", "prompt": [ids, SEQUENCES[1]], "max_tokens": 1,
                                           "prompt_logprobs": 3, "temperature": 0.0})
    entries = out["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    assert out["choices"][1]["prompt_logprobs"][0] is None and len(out["choices"][1]["prompt_logprobs"]) == 5
    # the two prompts went through one right-padded forward: the shorter one's values are unchanged
    assert torch.allclose(actual(out["choices"][1]["prompt_logprobs"], SEQUENCES[1]), in_process_logprobs(in_process)[1],
                          atol=1e-5, rtol=0)
    for p in range(1, len(ids)):
        entry, row = entries[p], logp[p - 1]
        top = row.topk(3).indices.tolist()
        assert set(entry) == {str(t) for t in top} | {str(ids[p])}  # k alternatives + the actual token
        for t, value in entry.items():
            assert value["rank"] == int((row > row[int(t)]).sum()) + 1
            assert abs(value["logprob"] - float(row[int(t)])) < 1e-5
    # the teacher temperature is applied by the server: log softmax(logits / T)
    hot = in_process_logprobs(in_process, temperature=0.7)[0]
    out = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 0,
                                           "prompt_logprobs_temperature": 0.7, "temperature": 1.0})
    got = actual(out["choices"][0]["prompt_logprobs"], ids)
    assert torch.allclose(got, hot, atol=1e-5, rtol=0)
    assert not torch.allclose(got, in_process_logprobs(in_process)[0], atol=1e-3)


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"prompt": [0, 1, 2], "prompt_logprobs": 6}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": [0, 1, 2], "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": [0, 1, 2], "prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": [0, 1, 2], "prompt_logprobs_temperature": 0.5}, "prompt_logprobs_temperature"),
    ("/v1/completions", {"prompt": [0, 1, 2], "prompt_logprobs": 0, "prompt_logprobs_temperature": 0},
     "prompt_logprobs_temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0,
                              "stream": True}, "prompt_logprobs"),
    ("/inference/v1/generate", {"token_ids": [0, 1], "sampling_params": {"prompt_logprobs": 9}},
     "sampling_params.prompt_logprobs"),
])
def test_refusals_name_the_field(server, path, body, field):
    out = post(server, path, body, status=400)
    assert out["error"]["param"] == field, out


def test_prompts_split_into_forwards_of_bounded_tokens_score_the_same(loaded):
    from megatron_s2.serve.prompt_logprobs import _batches, _score_batch

    assert _batches([[1] * 5, [1] * 2, [1] * 4], max_tokens=8) == [[1, 2], [0]]  # 2 x 4 fits, 3 x 5 does not
    assert _batches([[1] * 30], max_tokens=8) == [[0]]  # a prompt longer than the bound is one batch
    model = loaded[0]
    whole = _score_batch(model, SEQUENCES, 2, 1.0)  # one forward of 3 x 10 tokens
    split = [_score_batch(model, [prompt], 2, 1.0)[0] for prompt in SEQUENCES]  # one prompt per forward
    for a, b in zip(whole, split):
        assert torch.allclose(a[0], b[0], atol=1e-5, rtol=0) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


@pytest.mark.slow
def test_scoring_between_engine_steps_leaves_generation_unchanged(server, in_process):
    """Prompt scoring runs on the engine's driver thread between steps: a seeded generation
    interleaved with scoring requests is the one it is alone, and the scores are exact."""
    from concurrent.futures import ThreadPoolExecutor

    gen = {"token_ids": SEQUENCES[0], "sampling_params": {"max_tokens": 24, "temperature": 1.0, "seed": 7,
                                                           "logprobs": 0, "ignore_eos": True}}
    alone = post(server, "/inference/v1/generate", gen)["choices"][0]
    score = {"prompt": SEQUENCES, "max_tokens": 1, "prompt_logprobs": 0}
    with ThreadPoolExecutor(4) as pool:
        mixed = pool.submit(post, server, "/inference/v1/generate", gen)
        scores = [pool.submit(post, server, "/v1/completions", score) for _ in range(6)]
        mixed = mixed.result()["choices"][0]
        scores = [s.result() for s in scores]
    assert mixed["token_ids"] == alone["token_ids"]
    # the scoring requests' own 1-token generations share engine steps with it: float rounding only
    assert torch.allclose(torch.tensor([e["logprob"] for e in mixed["logprobs"]["content"]]),
                          torch.tensor([e["logprob"] for e in alone["logprobs"]["content"]]), atol=1e-5, rtol=0)
    ref = in_process_logprobs(in_process)
    for out in scores:
        for choice, ids, expected in zip(out["choices"], SEQUENCES, ref):
            assert torch.allclose(actual(choice["prompt_logprobs"], ids), expected, atol=1e-5, rtol=0)


def test_minus_one_returns_the_whole_distribution_when_the_server_allows_it(loaded, server):
    """vLLM's ``--max-logprobs -1`` and ``prompt_logprobs: -1``: every token of the vocabulary at
    every position (a served OPD teacher's full distribution), equal to the model's log-softmax;
    a server with the default cap refuses it naming its flag."""
    from megatron_s2.cli import build_parser

    model = loaded[0]
    vocab = model.config.vocab_size
    ids = SEQUENCES[1]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0, :-1].float() / 0.5, -1)
    whole = start_server(loaded, serve=ServeConfig(disconnect_poll_s=0.05, max_logprobs=-1))
    try:
        for k in (-1, vocab):
            out = post(whole, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": k,
                                                  "prompt_logprobs_temperature": 0.5})
            entries = out["choices"][0]["prompt_logprobs"]
            for p in range(1, len(ids)):
                assert sorted(map(int, entries[p])) == list(range(vocab))
                got = torch.tensor([entries[p][str(t)]["logprob"] for t in range(vocab)])
                assert torch.allclose(got, logp[p - 1], atol=1e-5, rtol=0)
                assert sorted(e["rank"] for e in entries[p].values()) == list(range(1, vocab + 1))
        refused = post(whole, "/v1/completions", {"prompt": ids, "prompt_logprobs": vocab + 1}, status=400)
        assert refused["error"]["param"] == "prompt_logprobs"
        assert refused["error"]["message"].startswith(f"prompt_logprobs: must be <= {vocab} (the vocabulary has "
                                                      f"{vocab} tokens), got {vocab + 1}"), refused
    finally:
        whole.stop()
    refused = post(server, "/v1/completions", {"prompt": ids, "prompt_logprobs": -1}, status=400)["error"]
    assert refused["message"].startswith(f"prompt_logprobs: must be <= 5 (this server's --max-logprobs; serve with "
                                         f"--max-logprobs -1 for the whole vocabulary of {vocab}), got -1 (the whole "
                                         f"vocabulary, {vocab})"), refused
    assert build_parser().parse_args(["serve", "ckpt", "--max-logprobs", "-1"]).max_logprobs == -1
    with pytest.raises(ConfigError, match=r"^--max-logprobs: must be >= 0, or -1 for the whole vocabulary, got -2$"):
        ServeConfig(max_logprobs=-2)
