"""Chat image parts through the real ``openai`` client (issue 22, "Images in inference and serving").

* ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` among text parts:
  the chat template places the image placeholder where the part stands (the rendered text split
  at the part), the engine expands it into the image's span, and the greedy answer is the model's
  own greedy continuation with the image (whole-sequence forward with the image mask).
* ``file://`` only under ``--allowed-local-media-path``, the same answer as inline bytes.
* Hostile images (truncated, decompression bombs, 100000x1, wrong MIME, animated, unsupported
  format) and remote URLs answer 400 naming the part and the problem, while concurrent good
  requests are served; RGBA / CMYK / 16-bit images are converted as images.py does, not refused.
* A model without a vision tower answers image parts with a 400; so do image parts outside user
  messages, ``<image>`` in the text next to image parts, and ``truncate_prompt_tokens`` with images.
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from megatron_s2.data.tokenizer import load_tokenizer
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.model import build_model
from megatron_s2.models.v41.vision.processor import TEXT, prepare_vl_inputs
from megatron_s2.serve import ServeConfig
from tests.data.test_images import animated, png_claiming
from tests.serve.conftest import start_server
from tests.vision.conftest import vision_config

ROOT = Path(__file__).resolve().parents[2]
IMAGE_ID = 515  # beyond the tokenizer's 512 ids: text never encodes to it
RTI = {"return_token_ids": True}


def png(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def noise(width=20, height=20, mode="RGB", seed=0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, len(mode)), dtype=np.uint8)
    return Image.fromarray(pixels, mode)


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def message_of(error: openai.APIStatusError) -> str:
    """The server's own error message (the client's ``message`` prefixes the status)."""
    return error.response.json()["error"]["message"]


def loaded_model(vision: bool):
    tokenizer = load_tokenizer(ROOT / "recipes" / "tokenizers" / "tiny-bpe")
    cfg = vision_config(vocab_size=520, image_token_id=IMAGE_ID, engram_pad_id=2,
                        **({} if vision else {"vision_n_layers": 0}))
    model = build_model(cfg, seed=3).eval()
    model.set_token_map(tokenizer.compressed_token_map(num_ids=cfg.vocab_size))
    return model, tokenizer, "vl-tiny" if vision else "text-tiny"


@pytest.fixture(scope="module")
def vl_loaded():
    return loaded_model(vision=True)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    directory = tmp_path_factory.mktemp("media")
    noise().save(directory / "picture.png")
    return directory


@pytest.fixture(scope="module")
def server(vl_loaded, media):
    srv = start_server(vl_loaded, name="vl", serve=ServeConfig(disconnect_poll_s=0.05,
                                                                 allowed_local_media_path=str(media)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def image_message(url: str, before="What is ", after=" here?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": before},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": after}]}]


def ask(client, messages, **kw):
    return client.chat.completions.create(model="vl", messages=messages, max_tokens=5, temperature=0,
                                          extra_body=RTI, **kw)


def greedy_with_image(model, prompt_ids, image, n, eos):
    ids, types, inputs = prepare_vl_inputs(prompt_ids, [image], model.config)
    out = []
    with torch.no_grad():
        for _ in range(n):
            x = torch.tensor([ids + out])
            mask = torch.tensor([[t != TEXT for t in types] + [False] * len(out)])
            ctx = ForwardContext.create(x, model.plan, image_mask=mask)
            nxt = int(model.head(*model.run_layers(model.embed(x, images=[inputs]), ctx))[0, -1].argmax())
            out.append(nxt)
            if nxt == eos:
                break
    return ids, out


def test_an_image_part_is_placed_by_the_template_and_answered_as_the_model_would(client, vl_loaded):
    model, tok, _ = vl_loaded
    image = noise()
    r = ask(client, image_message(data_url(png(image))))
    (c,) = r.choices
    # the template places the image where the part stands: the rendered text split at the part
    text = tok.apply_chat_template([{"role": "user", "content": "What is <image> here?"}], tokenize=False,
                                   add_generation_prompt=True)
    before, after = text.split("<image>")
    placeholders = tok.encode(before) + [IMAGE_ID] + tok.encode(after)
    ids, answer = greedy_with_image(model, placeholders, image, 5, tok.eos_id)
    span = ids.count(IMAGE_ID)
    assert span == 8  # a 20 x 20 image: a 2 x 2 token grid, newlines, start and end
    assert r.model_extra["prompt_token_ids"] == ids
    assert ids[len(tok.encode(before)):len(tok.encode(before)) + span] == [IMAGE_ID] * span
    assert c.model_extra["token_ids"] == answer and r.usage.prompt_tokens == len(ids)


def test_a_file_url_under_the_allowed_directory_answers_like_inline_bytes(client, media):
    inline = ask(client, image_message(data_url((media / "picture.png").read_bytes())))
    local = ask(client, image_message(f"file://{media / 'picture.png'}"))
    assert local.choices[0].model_extra["token_ids"] == inline.choices[0].model_extra["token_ids"]
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, image_message(f"file://{ROOT / 'README.md'}"))
    assert "outside the allowed local media path" in message_of(caught.value)


HOSTILE = {
    "truncated": (lambda: data_url(png(noise(64, 64))[:600]), "truncated or corrupt PNG"),
    "decompression bomb": (lambda: data_url(png_claiming(100_000, 100_000)), "decompression bomb refused"),
    "100000x1": (lambda: data_url(png(Image.new("L", (100_000, 1)))), "extreme aspect ratio 100000x1"),
    "wrong MIME": (lambda: data_url(png(noise()), "image/jpeg"), "declared as JPEG but the bytes are a PNG"),
    "animated": (lambda: data_url(animated("GIF"), "image/gif"), "animated GIF (2 frames) is not supported"),
    "TIFF": (lambda: data_url(png(noise(), "TIFF"), "image/png"), "unsupported image format TIFF"),
    "remote URL": (lambda: "https://example.com/cat.png", "remote image URLs are not fetched"),
    "not a URL": (lambda: "cat.png", "unsupported image URL scheme"),
}


def test_hostile_images_get_a_400_naming_the_problem_while_good_requests_are_served(client):
    good = image_message(data_url(png(noise(seed=4))))
    expected = ask(client, good).choices[0].model_extra["token_ids"]

    def hostile(case):
        make, words = HOSTILE[case]
        with pytest.raises(openai.BadRequestError) as caught:
            ask(client, image_message(make()))
        return case, caught.value.status_code, message_of(caught.value), words

    with ThreadPoolExecutor(6) as pool:
        good_answers = [pool.submit(ask, client, good) for _ in range(3)]
        refusals = list(pool.map(hostile, HOSTILE))
    for case, status, message, words in refusals:
        assert status == 400 and words in message, (case, message)
        assert message.startswith("messages[0].content[1].image_url.url: ") and "\n" not in message, message
    assert all(f.result().choices[0].model_extra["token_ids"] == expected for f in good_answers)


def test_a_request_with_more_images_than_the_cap_is_refused_before_any_is_decoded(client):
    """Each decoded image may hold up to ImageLimits.max_pixels (~96 MB as RGB) and a 97 KB PNG
    decodes to that: without a per-request count, one 16 MB body held ~160 of them at once."""
    cap = ServeConfig().max_images_per_request
    corrupt = data_url(b"\x89PNG\r\n\x1a\nbroken")  # never reached: the count is refused first
    parts = [{"type": "image_url", "image_url": {"url": data_url(png(noise()))}} for _ in range(cap)]
    parts.append({"type": "image_url", "image_url": {"url": corrupt}})
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, [{"role": "user", "content": parts}])
    assert message_of(caught.value) == (f"messages: {cap + 1} image parts; this server takes at most {cap} per "
                                        "request (--max-images-per-request)")
    r = ask(client, [{"role": "user", "content": parts[:cap]}])  # exactly the cap is served
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("mode", ["RGBA", "CMYK", "I;16"])
def test_alpha_cmyk_and_16_bit_images_are_converted_not_refused(client, mode):
    image = Image.new(mode, (20, 20)) if mode == "I;16" else noise(mode=mode)
    fmt, mime = ("JPEG", "image/jpeg") if mode == "CMYK" else ("PNG", "image/png")
    r = ask(client, image_message(data_url(png(image, fmt), mime)))
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("messages, field, words", [
    ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]},
      {"role": "user", "content": "hi"}], "messages[0].content[0]", "user messages only"),
    (image_message("URL", before="Look: <image> and "), "messages", "must not contain <image>"),
    ([{"role": "user", "content": [{"type": "audio", "audio": {}}]}], "messages[0].content[0]", "image parts"),
])
def test_misplaced_image_parts_are_refused(client, messages, field, words):
    messages = [{**m, "content": [{**p, "image_url": {"url": data_url(png(noise()))}} if p.get("type") == "image_url"
                                  else p for p in m["content"]]} if isinstance(m["content"], list) else m
                for m in messages]
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, messages)
    message = message_of(caught.value)
    assert message.startswith(f"{field}: ") and words in message, message


def test_image_parts_cannot_be_truncated_or_scored(client):
    messages = image_message(data_url(png(noise())))
    for extra, field in (({"truncate_prompt_tokens": 10}, "truncate_prompt_tokens"),
                         ({"prompt_logprobs": 1}, "prompt_logprobs")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="vl", messages=messages, max_tokens=2, extra_body=extra)
        assert message_of(caught.value).startswith(f"{field}: "), message_of(caught.value)


def test_a_model_without_a_vision_tower_refuses_image_parts():
    srv = start_server(loaded_model(vision=False), name="text")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="text", messages=image_message(data_url(png(noise()))),
                                           max_tokens=2)
        assert message_of(caught.value) == ("messages[0].content[1]: this model takes no images (it has no vision "
                                        "tower); send text parts only")
        text = client.chat.completions.create(model="text", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)
        assert text.choices[0].finish_reason in ("stop", "length")
    finally:
        srv.stop()


def test_a_tokenizer_that_renders_ids_gets_the_markers_ids_replaced():
    """The character tokenizer renders a chat to ids, not text: the marker's ids become the placeholder."""
    from megatron_s2.config.engine import EngineConfig
    from megatron_s2.data.tokenizer import CharTokenizer
    from megatron_s2.inference import InferenceEngine
    from megatron_s2.serve.chat import chat_prompt_ids
    from megatron_s2.serve.fields import Fields
    from megatron_s2.serve.media import ServedImages

    tok = CharTokenizer()
    model = build_model(vision_config(vocab_size=110, image_token_id=105), seed=0).eval()
    images = ServedImages(InferenceEngine(model, EngineConfig(max_num_seqs=1, page_tokens=8)))
    body = {"messages": image_message(data_url(png(noise())), before="hi ", after=" x")}
    ids, spans = chat_prompt_ids(tok, Fields(body), lambda texts, field: None, images)
    marked = tok.apply_chat_template([{"role": "user", "content": "hi <image> x"}], add_generation_prompt=True)
    marker = tok.encode("<image>")
    at = next(i for i in range(len(marked)) if marked[i:i + len(marker)] == marker)
    (span,) = spans
    assert span.start == at and ids[at:span.end] == [105] * span.length
    assert ids[:at] + ids[span.end:] == marked[:at] + marked[at + len(marker):]
