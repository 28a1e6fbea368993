"""Every vLLM request field is honoured or refused with a 400 naming it — never accepted and
silently ignored (review 14 found a dozen that were). Implemented here: ``echo`` (also with
``max_tokens: 0``, how evaluation harnesses score log-likelihoods), ``include_stop_str_in_output``,
``skip_special_tokens``, ``truncate_prompt_tokens`` (+ ``truncation_side``),
``stream_options.continuous_usage_stats``, ``logprob_token_ids``, ``continue_final_message``, chat
``echo``, chat ``add_special_tokens``, chat ``prompt_logprobs`` and ``stream: true`` on
``/inference/v1/generate``. Refused unless neutral: beam search, structured output
(``structured_outputs``, ``guided_*``, a ``response_format`` other than text), ``priority``, a
request ``chat_template``, ``tool_choice`` without tools, ``documents``."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

CHAT = [{"role": "user", "content": "What is two plus two?"}]


def post(server, path, body, status=200):
    r = httpx.post(f"{server.url}{path}", json={"model": "tiny", **body}, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def events(server, path, body) -> list[dict]:
    """The JSON events of a streamed answer (ending with ``[DONE]``)."""
    r = httpx.post(f"{server.url}{path}", json={"model": "tiny", "stream": True, **body}, timeout=120)
    assert r.status_code == 200, r.text
    lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def log_softmax_rows(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log-probs of the token after each position."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].double(), -1)


# ---- refused unless neutral --------------------------------------------------------------------
@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"prompt": "a", "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "a", "guided_regex": "a+"}, "guided_regex"),
    ("/v1/chat/completions", {"messages": CHAT, "guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/completions", {"prompt": "a", "guided_choice": ["yes", "no"]}, "guided_choice"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
    ("/v1/completions", {"prompt": "a", "priority": 5}, "priority"),
    ("/v1/chat/completions", {"messages": CHAT, "priority": -1}, "priority"),
    ("/v1/completions", {"prompt": "a", "priority": False}, "priority"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": "garbage"}, "stream_options"),
    ("/v1/completions", {"prompt": "a", "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
    ("/v1/completions", {"prompt": "a", "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("/v1/completions", {"prompt": "a", "stream": True, "stream_options": {"usage": True}}, "stream_options.usage"),
    ("/v1/completions", {"prompt": "a", "logprob_token_ids": [5]}, "logprob_token_ids"),
    ("/v1/completions", {"prompt": "a", "logprobs": 1, "logprob_token_ids": []}, "logprob_token_ids"),
    ("/v1/completions", {"prompt": "a", "logprobs": 1, "logprob_token_ids": [10 ** 6]}, "logprob_token_ids"),
    ("/v1/completions", {"prompt": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "a", "truncate_prompt_tokens": 257}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "a", "truncate_prompt_tokens": 2, "truncation_side": "middle"},
     "truncation_side"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "seed": 2 ** 63}, "seed"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "documents": [{"title": "t", "text": "x"}]}, "documents"),
    ("/v1/chat/completions", {"messages": CHAT + [{"role": "assistant", "content": "Fo"}],
                              "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/inference/v1/generate", {"token_ids": [1, 2], "stream_options": {"include_usage": True}}, "stream_options"),
    ("/inference/v1/generate", {"token_ids": [1, 2], "stream": True,
                                "sampling_params": {"prompt_logprobs": 0}}, "sampling_params.prompt_logprobs"),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"structured_outputs": {"regex": "a"}}},
     "sampling_params.structured_outputs"),
])
def test_a_field_the_server_cannot_honour_is_a_400_naming_it(server, path, body, field):
    r = httpx.post(f"{server.url}{path}", json={"model": "tiny", "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith(f"{field}: "), error
    assert error["param"] == field.split(": ")[0]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "a", "use_beam_search": False, "priority": 0, "response_format": {"type": "text"},
                         "stream_options": None, "spaces_between_special_tokens": True, "guided_json": None,
                         "structured_outputs": None, "length_penalty": 1.0}),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "none", "chat_template": None, "documents": None,
                              "continue_final_message": False, "echo": False}),
    ("/inference/v1/generate", {"token_ids": [1, 2], "priority": 0, "stream": False,
                                "sampling_params": {"max_tokens": 2, "skip_special_tokens": True}}),
])
def test_neutral_values_are_accepted(server, path, body):
    post(server, path, {"max_tokens": 2, **body} if "sampling_params" not in body else body)


# ---- echo ---------------------------------------------------------------------------------------
def test_echo_with_max_tokens_0_returns_the_prompts_log_probs(server, loaded):
    """How lm-eval and other harnesses score a log-likelihood: ``echo`` with ``logprobs`` and no
    generation returns the prompt's tokens with their log-probs (the first has none)."""
    model, tok, _ = loaded
    prompt = [tok.bos_id] + tok.encode("Two plus two is four")
    out = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2,
                                          "return_tokens_as_token_ids": True})
    (choice,) = out["choices"]
    assert choice["text"] == tok.decode(prompt) and choice["finish_reason"] == "length"
    records = choice["logprobs"]
    assert records["tokens"] == [f"token_id:{t}" for t in prompt]
    assert records["token_logprobs"][0] is None and records["top_logprobs"][0] is None
    expected = log_softmax_rows(model, prompt)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(records["token_logprobs"][1:], dtype=torch.float64), expected, atol=1e-5)
    for position in range(1, len(prompt)):
        top = records["top_logprobs"][position]
        best = log_softmax_rows(model, prompt)[position - 1].topk(2).indices.tolist()
        assert set(top) == {f"token_id:{t}" for t in [prompt[position], *best]}  # the token + the top 2
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 0, "total_tokens": len(prompt)}


def test_echo_prepends_the_prompt_to_text_and_log_probs(server, loaded):
    model, tok, _ = loaded
    text = "The cat sat"
    out = post(server, "/v1/completions", {"prompt": text, "max_tokens": 3, "temperature": 0, "echo": True,
                                          "logprobs": 0, "return_token_ids": True})
    (choice,) = out["choices"]
    prompt, generated = choice["prompt_token_ids"], choice["token_ids"]
    assert choice["text"] == text + tok.decode(generated)
    records = choice["logprobs"]
    assert len(records["token_logprobs"]) == len(prompt) + len(generated)
    rows = log_softmax_rows(model, prompt + generated)[:-1]
    expected = rows.gather(1, torch.tensor((prompt + generated)[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(records["token_logprobs"][1:], dtype=torch.float64), expected, atol=1e-4)
    assert records["text_offset"][0] == 0 and records["text_offset"][len(prompt)] == len(text)
    streamed = events(server, "/v1/completions", {"prompt": text, "max_tokens": 3, "temperature": 0, "echo": True,
                                                  "logprobs": 0})
    assert "".join(e["choices"][0]["text"] for e in streamed) == choice["text"]
    assert [v for e in streamed for v in e["choices"][0]["logprobs"]["token_logprobs"]] == records["token_logprobs"]


def test_skip_special_tokens_false_keeps_their_text(server, loaded):
    """An echoed token-id prompt is decoded like generated text (a text prompt is echoed as it was
    sent, as vLLM does); test_text.py checks the generated side."""
    _, tok, _ = loaded
    prompt = [tok.bos_id] + tok.encode("Hi")
    kept = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True,
                                           "skip_special_tokens": False})["choices"][0]["text"]
    assert kept == tok.decode([tok.bos_id], keep_special=True) + "Hi"
    assert post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True})["choices"][0]["text"] \
        == "Hi"
    text = "Hi"
    assert post(server, "/v1/completions", {"prompt": text, "max_tokens": 0, "echo": True,
                                           "skip_special_tokens": False})["choices"][0]["text"] == text


# ---- text and prompt options -------------------------------------------------------------------
@pytest.mark.slow
def test_include_stop_str_in_output_keeps_the_stop_string(server):
    base = {"prompt": "Stop here", "max_tokens": 24, "temperature": 0}
    text = post(server, "/v1/completions", base)["choices"][0]["text"]
    at = next(i for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    stop = text[at:at + 2]
    cut = text[:text.index(stop) + len(stop)]
    body = {**base, "stop": [stop], "include_stop_str_in_output": True}
    assert post(server, "/v1/completions", body)["choices"][0]["text"] == cut
    assert "".join(e["choices"][0]["text"] for e in events(server, "/v1/completions", body)) == cut
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 24, "temperature": 0})
    reply = chat["choices"][0]["message"]["content"]
    at = next(i for i in range(1, len(reply) - 1) if "\ufffd" not in reply[i:i + 2])
    stop = reply[at:at + 2]
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 24, "temperature": 0,
                                                "stop": [stop], "include_stop_str_in_output": True})
    assert chat["choices"][0]["message"]["content"] == reply[:reply.index(stop) + len(stop)]


@pytest.mark.parametrize("side", [None, "left", "right"])
def test_truncate_prompt_tokens_keeps_that_many_prompt_tokens(server, loaded, side):
    _, tok, _ = loaded
    text = "one two three four five six seven"
    full = [tok.bos_id] + tok.encode(text)
    kept = full[:4] if side == "right" else full[-4:]
    extra = {"truncate_prompt_tokens": 4, **({"truncation_side": side} if side else {})}
    out = post(server, "/v1/completions", {"prompt": text, "max_tokens": 1, "return_token_ids": True, **extra})
    assert out["choices"][0]["prompt_token_ids"] == kept and out["usage"]["prompt_tokens"] == 4
    out = post(server, "/inference/v1/generate", {"token_ids": full, "sampling_params": {"max_tokens": 1, **extra}})
    assert out["prompt_token_ids"] == kept
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "return_token_ids": True,
                                                "truncate_prompt_tokens": 4})
    assert chat["prompt_token_ids"] == tok.apply_chat_template(CHAT, add_generation_prompt=True)[-4:]
    # -1: truncate to the context length; a text over it is then served, not refused
    huge = "ab " * 200_000
    out = post(server, "/v1/completions", {"prompt": huge, "max_tokens": 1, "truncate_prompt_tokens": 200,
                                          "return_token_ids": True})
    assert len(out["choices"][0]["prompt_token_ids"]) == 200


def test_continuous_usage_stats_puts_usage_in_every_chunk(server):
    chunks = events(server, "/v1/completions", {"prompt": [1, 40, 41], "max_tokens": 4, "temperature": 0,
                                                "ignore_eos": True, "stream_options": {"include_usage": True,
                                                                                       "continuous_usage_stats": True}})
    generated = 0
    for chunk in chunks[:-1]:
        generated += 1
        assert chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": generated, "total_tokens": 3 + generated}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    chat = events(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "ignore_eos": True,
                                                   "stream_options": {"include_usage": True,
                                                                      "continuous_usage_stats": True}})
    assert all(chunk.get("usage") for chunk in chat)


def test_logprob_token_ids_report_the_asked_tokens_at_every_position(server, loaded):
    model, _, _ = loaded
    prompt = [1, 40, 41, 42]
    out = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 1,
                                          "logprob_token_ids": [5, 9], "return_token_ids": True,
                                          "return_tokens_as_token_ids": True})
    (choice,) = out["choices"]
    rows = log_softmax_rows(model, prompt + choice["token_ids"])[len(prompt) - 1:-1]
    for position, (token, top) in enumerate(zip(choice["token_ids"], choice["logprobs"]["top_logprobs"])):
        assert set(top) == {f"token_id:{t}" for t in (token, 5, 9)}
        for asked in (5, 9):
            assert abs(top[f"token_id:{asked}"] - float(rows[position, asked])) < 1e-4
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "logprobs": True,
                                                "logprob_token_ids": [9, 5], "return_tokens_as_token_ids": True})
    for entry in chat["choices"][0]["logprobs"]["content"]:
        assert [t["token"] for t in entry["top_logprobs"]] == ["token_id:9", "token_id:5"]


# ---- chat ----------------------------------------------------------------------------------------
def test_continue_final_message_and_echo_continue_the_assistants_text(server, loaded):
    _, tok, _ = loaded
    messages = CHAT + [{"role": "assistant", "content": "The answer is"}]
    out = post(server, "/v1/chat/completions", {"messages": messages, "continue_final_message": True,
                                               "add_generation_prompt": False, "echo": True, "max_tokens": 4,
                                               "temperature": 0, "return_token_ids": True})
    rendered = tok.apply_chat_template(messages, tokenize=False)
    expected = tok.encode(rendered[:rendered.rindex("The answer is") + len("The answer is")])
    assert out["prompt_token_ids"] == expected and expected[-1] != tok.eos_id
    (choice,) = out["choices"]
    assert choice["message"]["content"] == "The answer is" + tok.decode(choice["token_ids"])
    streamed = events(server, "/v1/chat/completions", {"messages": messages, "continue_final_message": True,
                                                       "add_generation_prompt": False, "echo": True,
                                                       "max_tokens": 4, "temperature": 0})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed if e["choices"])
    assert text == choice["message"]["content"]


def test_chat_add_special_tokens_adds_bos_on_top_of_the_template(server, loaded):
    _, tok, _ = loaded
    plain = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "return_token_ids": True})
    extra = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "return_token_ids": True,
                                                 "add_special_tokens": True})
    assert extra["prompt_token_ids"] == [tok.bos_id] + plain["prompt_token_ids"]


def test_chat_prompt_logprobs_score_the_rendered_prompt(server, loaded):
    model, tok, _ = loaded
    out = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "prompt_logprobs": 1,
                                               "return_token_ids": True})
    prompt = out["prompt_token_ids"]
    entries = out["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    rows = log_softmax_rows(model, prompt)
    for position in range(1, len(prompt)):
        value = entries[position][str(prompt[position])]["logprob"]
        assert abs(value - float(rows[position - 1, prompt[position]])) < 1e-5


# ---- /inference/v1/generate streaming ----------------------------------------------------------
def test_the_token_endpoint_streams_like_vllm(server):
    body = {"token_ids": [1, 40, 41, 42], "sampling_params": {"max_tokens": 6, "temperature": 1.0, "seed": 3,
                                                              "logprobs": 1, "n": 2}}
    whole = post(server, "/inference/v1/generate", body)
    chunks = events(server, "/inference/v1/generate", {**body, "stream_options": {"include_usage": True}})
    for index in range(2):
        parts = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert [t for p in parts for t in p["token_ids"]] == whole["choices"][index]["token_ids"]
        assert [e for p in parts for e in p["logprobs"]["content"]] == whole["choices"][index]["logprobs"]["content"]
        assert parts[-1]["finish_reason"] == whole["choices"][index]["finish_reason"]
        assert all(p["finish_reason"] is None for p in parts[:-1])
        assert all(set(c) >= {"request_id", "choices"} for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
