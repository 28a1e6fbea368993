"""The server through the real ``openai`` client on a checkpoint the session trained: the model
list, greedy completions equal to the model's own greedy continuation, streaming (server-sent
events) equal to the plain answer, ``n`` choices with seeds, concurrent clients, token-in /
token-out with log-probs equal to the model's, stop strings, and bad requests answered 400 /
404 with the field named."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from tests.serve.conftest import start_server

RTI = {"return_token_ids": True}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def full_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0]


def greedy(model, prompt, n, eos):
    out = []
    for _ in range(n):
        nxt = int(full_logits(model, prompt + out)[-1].argmax())
        out.append(nxt)
        if nxt == eos:
            break
    return out


def test_models_lists_the_model_and_max_model_len(client):
    (card,) = client.models.list().data
    assert card.id == "tiny" and card.model_extra["max_model_len"] == 256


def test_greedy_completion_is_the_models_greedy_continuation(client, loaded):
    model, tok, _ = loaded
    r = client.completions.create(model="tiny", prompt="Hello, world", max_tokens=8, temperature=0, extra_body=RTI)
    (c,) = r.choices
    prompt = [tok.bos_id] + tok.encode("Hello, world")
    assert c.model_extra["prompt_token_ids"] == prompt
    ids = c.model_extra["token_ids"]
    assert ids == greedy(model, prompt, 8, tok.eos_id)
    assert c.text == tok.decode(ids) and c.model_extra["policy_versions"] == [0] * len(ids)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ids)
    assert c.finish_reason == ("stop" if ids[-1] == tok.eos_id else "length") and c.model_extra["stop_reason"] is None


def test_streaming_sends_the_same_completion_as_events(client, server):
    kw = dict(model="tiny", prompt=[0, 40, 41, 42], max_tokens=10, temperature=0.8, seed=5, extra_body=RTI)
    plain = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert text == plain.text and ids == plain.model_extra["token_ids"]
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == [0, 40, 41, 42]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    # the wire format: "data: {json}" events separated by a blank line, ending with [DONE]
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 3, "stream": True}
    raw = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = raw.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_n_choices_with_a_seed_differ_and_reproduce(client):
    kw = dict(model="tiny", prompt="The cat", max_tokens=6, temperature=1.0, extra_body=RTI)
    first = client.completions.create(n=3, seed=7, **kw)
    again = client.completions.create(n=3, seed=7, **kw)
    ids = [c.model_extra["token_ids"] for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert ids == [c.model_extra["token_ids"] for c in again.choices]
    assert len({tuple(i) for i in ids}) > 1
    alone = client.completions.create(n=1, seed=8, **kw).choices[0]  # choice j samples with seed + j
    assert alone.model_extra["token_ids"] == ids[1]


@pytest.mark.slow
def test_concurrent_clients_get_what_they_get_alone(client):
    requests = [dict(model="tiny", prompt=f"request {i}: ", max_tokens=6 + i, temperature=1.0, seed=100 + i,
                     extra_body=RTI) for i in range(6)]
    alone = [client.completions.create(**kw).choices[0].model_extra["token_ids"] for kw in requests]
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda kw: client.completions.create(**kw), requests))
    assert [r.choices[0].model_extra["token_ids"] for r in together] == alone


def test_token_in_token_out_with_the_models_log_probs(client, loaded):
    model, _, _ = loaded
    prompt = [0, 20, 21, 22, 23, 24]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, seed=3, logprobs=2,
                                  extra_body={**RTI, "return_tokens_as_token_ids": True})
    c = r.choices[0]
    ids = c.model_extra["token_ids"]
    assert c.model_extra["prompt_token_ids"] == prompt
    assert c.logprobs.tokens == [f"token_id:{t}" for t in ids]
    logits = full_logits(model, prompt + ids)[len(prompt) - 1:-1]
    ref = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(c.logprobs.token_logprobs, dtype=torch.float64), ref, atol=1e-4)
    top = torch.log_softmax(logits[0].double(), -1).topk(2)
    # the token itself, then the top 2 (up to logprobs + 1 entries, as OpenAI and vLLM report them)
    expected = dict.fromkeys(f"token_id:{t}" for t in [ids[0], *top.indices.tolist()])
    assert list(c.logprobs.top_logprobs[0]) == list(expected)


@pytest.mark.slow
def test_stop_strings_are_cut_from_the_text(client):
    base = dict(model="tiny", prompt="Stop here", max_tokens=24, temperature=0, extra_body=RTI)
    text = client.completions.create(**base).choices[0].text
    at = next(i for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    stop = text[at:at + 2]
    cut = text[:text.index(stop)]
    r = client.completions.create(**base, stop=[stop]).choices[0]
    assert (r.text, r.finish_reason, r.model_extra["stop_reason"]) == (cut, "stop", stop)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**base, stop=[stop], stream=True))
    assert streamed == cut
    # a stop token id ends the choice after that token; stop_reason names it (None for <eos>, as vLLM)
    ids = client.completions.create(**base).choices[0].model_extra["token_ids"]
    r = client.completions.create(**{**base, "extra_body": {**RTI, "stop_token_ids": [ids[3]]}}).choices[0]
    assert r.model_extra["token_ids"] == ids[:ids.index(ids[3]) + 1]
    assert (r.finish_reason, r.model_extra["stop_reason"]) == ("stop", ids[3])


@pytest.mark.parametrize("kw, status, words", [
    (dict(temperature=-1), 400, "temperature"),
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(n=0), 400, "n: must be >= 1"),
    (dict(prompt=[5] * 300), 400, "maximum context length is 256"),
    (dict(prompt=[5] * 200, max_tokens=100), 400, "max_tokens: This model's maximum context length"),
    (dict(prompt=[0, 100000]), 400, "prompt: token id 100000 is outside the vocabulary"),
    (dict(presence_penalty=0.5), 400, "presence_penalty"),
    (dict(suffix="and so on"), 400, "suffix: not supported"),
    (dict(extra_body={"use_beam_search": True}), 400, "use_beam_search: not supported"),
    (dict(model="gpt-4"), 404, "model"),
])
def test_bad_requests_name_the_field(client, kw, status, words):
    args = {"model": "tiny", "prompt": "x", "max_tokens": 2, **kw}
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(**args)
    assert err.value.status_code == status and words in err.value.message


@pytest.mark.parametrize("body, words", [
    (b"{not json", "request body: not valid JSON"),
    (b"[1, 2]", "request body: must be a JSON object"),
    (b'{"prompt": "x", "stream": "yes"}', "stream: must be true or false"),
    (b'{"prompt": {"a": 1}}', "prompt: must be"),
    (b'{"messages": [{"role": "robot", "content": "x"}]}', None),
])
def test_malformed_bodies_are_400(server, body, words):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    r = httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    if words:
        assert error["message"].startswith(words)


# ---- chat ---------------------------------------------------------------------------------------
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def test_chat_renders_with_the_tokenizers_chat_template(client, loaded):
    model, tok, _ = loaded
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0, extra_body=RTI)
    prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    assert r.model_extra["prompt_token_ids"] == prompt
    (c,) = r.choices
    ids = c.model_extra["token_ids"]
    assert ids == greedy(model, prompt, 8, tok.eos_id)
    assert c.message.role == "assistant" and c.message.content == tok.decode(ids)
    effort = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, extra_body={
        **RTI, "chat_template_kwargs": {"reasoning_effort": 40}})
    assert effort.model_extra["prompt_token_ids"] == tok.apply_chat_template(CHAT, add_generation_prompt=True,
                                                                            reasoning_effort=40)


def test_chat_streaming_with_n_and_log_probs(client):
    kw = dict(model="tiny", messages=CHAT, max_tokens=6, temperature=1.0, seed=9, n=2, logprobs=True, top_logprobs=2)
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    for choice in plain.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        streamed = [e for c in mine if c.logprobs for e in c.logprobs.content]
        assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in choice.logprobs.content]
        assert all(len(e.top_logprobs) == 2 for e in streamed)
        assert mine[-1].finish_reason == choice.finish_reason
    assert plain.choices[0].message.content != plain.choices[1].message.content or \
        [e.token for e in plain.choices[0].logprobs.content] != [e.token for e in plain.choices[1].logprobs.content]


@pytest.mark.parametrize("kw, words", [
    (dict(messages=[{"role": "robot", "content": "x"}]), "messages[0].role: must be one of"),
    (dict(messages=[]), "messages: must be a non-empty list"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0]: this model takes no images"),  # a text-only model (tests/serve/test_images.py)
    (dict(messages=CHAT, tools=[{"type": "web_search"}]), "tools[0]: only"),  # tools: tests/serve/test_gateway.py
    (dict(messages=CHAT, top_logprobs=2), "top_logprobs: needs logprobs: true"),
    (dict(messages=CHAT, extra_body={"chat_template_kwargs": {"reasoning_effort": 500}}),
     "chat_template_kwargs.reasoning_effort: must be <= 100"),
    (dict(messages=CHAT, extra_body={"chat_template_kwargs": {"enable_thinking": True}}),
     "chat_template_kwargs.enable_thinking: unknown field"),
])
def test_bad_chat_requests_name_the_field(client, kw, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", max_tokens=2, **kw)
    assert err.value.response.json()["error"]["message"].startswith(words), err.value.message


class TextOnlyTokenizer:
    """The run's tokenizer seen through the text protocol only (a tokenizer without a chat
    template, as a third-party tokenizer object can be)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        if name in ("apply_chat_template", "chat_segments", "has_chat_template"):
            raise AttributeError(name)
        return getattr(self._tokenizer, name)


def test_a_tokenizer_without_a_chat_template_answers_400(loaded):
    model, tok, description = loaded
    srv = start_server((model, TextOnlyTokenizer(tok), description))
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="this model has no chat template"):
            client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
        assert client.completions.create(model="tiny", prompt="still fine", max_tokens=2).choices[0].text is not None
    finally:
        srv.stop()
