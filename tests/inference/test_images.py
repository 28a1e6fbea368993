"""Images in the engine (report §2.1.1): spans embedded once and merged during chunked prefill,
the image mask fed to the MoE routers and Engram, and prefix caching keyed on image content.

* Incremental decode of a prompt with one or two images — chunked prefill whose chunks cut
  through the spans — gives the logits of the whole-sequence forward with images (``V41Model.embed
  (ids, images=)`` + the image mask in the context) at every position; the routers' image biases
  are randomised so that a missing image mask would show.
* The engine's greedy decode with images equals the full forward's argmax and log-probs.
* Prefix caching: the same image shares the cached prefix; the same placeholders with different
  pixels must not (the classic bug of keying on token ids), and the result stays exact.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from megatron_s2.inference import EngineConfig, InferenceEngine, SamplingParams
from megatron_s2.inference.request import Request
from megatron_s2.models.family.engine import Chunk, ImageSpan
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.inference.executor import V41Executor
from megatron_s2.models.v41.model import build_model
from megatron_s2.models.v41.vision.processor import TEXT, prepare_vl_inputs
from tests.vision.conftest import vision_config

RTOL = 1e-5
PLACEHOLDER = 100  # tests/vision/conftest.py: image_token_id


def picture(width: int, height: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def text(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 128, (n,), generator=g)
    return ids.masked_fill(ids == PLACEHOLDER, 7).tolist()


@pytest.fixture(scope="module")
def model():
    cfg = vision_config()
    model = build_model(cfg, seed=5).eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for router in model.routers():  # image and text biases far apart: a lost image mask changes routing
            router.image_expert_bias.copy_(torch.randn(router.image_expert_bias.shape, generator=g))
    return model


def full_logits(model, tokens, types, inputs, image_mask=True):
    """The whole-sequence forward with images: spans merged, the image mask in the context."""
    ids = torch.tensor([tokens])
    mask = torch.tensor([[t != TEXT for t in types]]) if image_mask else None
    ctx = ForwardContext.create(ids, model.plan, image_mask=mask)
    with torch.no_grad():
        return model.head(*model.run_layers(model.embed(ids, images=[inputs]), ctx))[0]


def prompt_with_images(model, sizes, seed=0):
    """text, image, text (, image, text) -> (tokens, types, ImageInputs, Pillow images)."""
    images = [picture(w, h, seed + i) for i, (w, h) in enumerate(sizes)]
    prompt = text(4, seed)
    for i in range(len(images)):
        prompt += [PLACEHOLDER] + text(3 + 2 * i, seed + 10 + i)
    tokens, types, inputs = prepare_vl_inputs(prompt, images, model.config)
    return prompt, images, tokens, types, inputs


def incremental_logits(model, tokens, spans, prompt_len, chunk):
    """Chunked prefill of ``prompt_len`` tokens, then one token per step, through the executor."""
    ex = V41Executor(model, EngineConfig(max_num_seqs=1, max_model_len=128, page_tokens=8), torch.device("cpu"))
    req = Request("r", tokens, SamplingParams(), torch.Generator(), 0, images=spans)
    ex.admit(req)
    out = []
    while req.num_computed < len(tokens):
        n = min(chunk, prompt_len - req.num_computed) if req.num_computed < prompt_len else 1
        [res] = ex.forward([Chunk(req, req.num_computed, n, "all")])
        req.num_computed += n
        ex.after_forward(req)
        out.append(res.logits)
    ex.release(req)
    return torch.cat(out)


@pytest.mark.parametrize("chunk", [3, 7])
@pytest.mark.parametrize("sizes", [[(20, 20)], [(20, 20), (30, 24)]], ids=["one-image", "two-images"])
def test_incremental_decode_with_images_equals_the_full_forward(model, sizes, chunk):
    prompt, images, tokens, types, inputs = prompt_with_images(model, sizes)
    ex = V41Executor(model, EngineConfig(max_num_seqs=1, page_tokens=8), torch.device("cpu"))
    expanded, spans = ex.prepare_images(prompt, images)
    assert expanded == tokens and [(s.start, s.length) for s in spans] == [(i.start, i.types.numel()) for i in inputs]
    # every span crosses at least one chunk boundary (the spans are 8 and 11 positions long)
    assert all(s.start // chunk != (s.end - 1) // chunk for s in spans)
    seq = tokens + text(6, seed=99)  # prompt, then six teacher-forced decode steps
    got = incremental_logits(model, seq, spans, len(tokens), chunk)
    ref = full_logits(model, seq, types + [TEXT] * 6, inputs)
    err = (got - ref).abs().max() / ref.abs().max()
    assert err <= RTOL, f"max |decode - forward| / max |forward| = {err:.2e}"
    unmasked = full_logits(model, seq, types + [TEXT] * 6, inputs, image_mask=False)
    assert (unmasked - ref).abs().max() / ref.abs().max() > 100 * RTOL  # the image mask matters here


def test_each_image_is_embedded_once_per_request(model):
    prompt, images, tokens, _, _ = prompt_with_images(model, [(20, 20), (30, 24)])
    calls = []
    real = model.vision.span_embeddings
    model.vision.span_embeddings = lambda image, dtype: calls.append(image.start) or real(image, dtype)
    try:
        engine = InferenceEngine(model, EngineConfig(max_num_seqs=1, max_model_len=128, prefill_chunk=3,
                                                     max_prefill_tokens=3, page_tokens=8))
        handle = engine.submit(prompt, SamplingParams(max_tokens=2, temperature=0), images=images)
        while engine.has_work():
            engine.step()
        handle.result()
    finally:
        del model.vision.span_embeddings
    assert sorted(calls) == sorted({c for c in calls}) and len(calls) == 2


def run(engine, prompt, images, max_tokens=6):
    handle = engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1), images=images)
    while engine.has_work():
        engine.step()
    return handle.prompt_token_ids, handle.result()


def test_greedy_engine_decode_with_images_equals_the_full_forward(model):
    prompt, images, tokens, types, inputs = prompt_with_images(model, [(20, 20), (30, 24)])
    engine = InferenceEngine(model, EngineConfig(max_num_seqs=2, max_model_len=128, prefill_chunk=5,
                                                 max_prefill_tokens=5, page_tokens=8))
    expanded, result = run(engine, prompt, images)
    assert expanded == tokens
    logits = full_logits(model, tokens + result.token_ids, types + [TEXT] * 6, inputs)[len(tokens) - 1:-1]
    assert result.token_ids == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(result.logprobs), ref, atol=1e-5)


def caching_engine(model, **kw):
    cfg = dict(max_num_seqs=1, max_model_len=128, prefill_chunk=64, max_prefill_tokens=64, page_tokens=8,
               prefix_caching=True)
    eng = InferenceEngine(model, EngineConfig(**{**cfg, **kw}))
    eng.processed = []
    real = eng.executor.runner.forward

    def counting(rows, **k):
        eng.processed.append(sum(len(r.tokens) for r in rows))
        return real(rows, **k)

    eng.executor.runner.forward = counting
    return eng


@pytest.mark.parametrize("tier", ["prefix-pages", "swa-snapshot"])
def test_prefix_cache_is_keyed_on_image_content_not_placeholders(model, tier):
    """The same image shares the cached prefix; another image behind the same placeholder ids
    does not, and its answer is the full forward's."""
    kw = {"swa_pool_slots": 2} if tier == "swa-snapshot" else {}
    prompt = text(3, 1) + [PLACEHOLDER] + text(20, 2)  # the 8-token span sits on the first pages
    first, second = picture(20, 20, seed=1), picture(20, 20, seed=2)
    eng = caching_engine(model, **kw)
    tokens, a = run(eng, prompt, [first])
    tiers = eng.executor.tiers
    assert sum(tiers.hits.values()) == 0
    _, again = run(eng, prompt, [first])  # the same picture: the cached prefix is used
    assert sum(tiers.hits.values()) >= 1 and again.token_ids == a.token_ids
    assert eng.processed[-len(again.token_ids) - 1] < len(tokens)
    hits = dict(tiers.hits)
    _, other = run(eng, prompt, [second])  # same ids, different pixels: nothing shared
    assert tiers.hits == hits
    _, types, inputs = prepare_vl_inputs(prompt, [second], model.config)
    logits = full_logits(model, tokens + other.token_ids, types + [TEXT] * 6, inputs)[len(tokens) - 1:-1]
    assert other.token_ids == logits.argmax(-1).tolist()


def test_prepared_inputs_and_spans_are_accepted_and_bad_images_refused(model, tiny_cfg):
    prompt, images, tokens, types, inputs = prompt_with_images(model, [(20, 20)])
    engine = InferenceEngine(model, EngineConfig(max_num_seqs=1, max_model_len=128, page_tokens=8))
    expanded, spans = engine.prepare_images(tokens, inputs)  # prepared inputs: the prompt holds the spans
    assert expanded == tokens and isinstance(spans[0], ImageSpan)
    _, from_pixels = engine.prepare_images(prompt, images)
    assert spans[0].key == from_pixels[0].key
    _, other = engine.prepare_images(prompt, [picture(20, 20, seed=3)])
    assert other[0].key != spans[0].key
    with pytest.raises(ValueError, match="1 image placeholders .* but 2 images"):
        engine.prepare_images(prompt, images * 2)
    with pytest.raises(ValueError, match="does not hold its span"):
        engine.prepare_images(prompt, inputs)
    text_only = InferenceEngine(build_model(tiny_cfg, seed=0).eval(), EngineConfig(max_num_seqs=1, page_tokens=8))
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.add_request(prompt, images=images)


@pytest.mark.parametrize("chunk", [5, 64], ids=["chunked", "one-chunk"])
def test_decoder_bounded_replay_with_an_image_across_the_replay_start(model, chunk):
    """Decoder SWA Bounded Replay (§3.2.2) runs the decoder from s = prompt - W: the image span
    straddles s, so the decoder's sub-batch takes the span's tail rows and image mask; the
    answer equals the train-aware full forward (``ctx.swa_from = s``) with the image."""
    w = model.config.window_size
    prompt = text(4, 5) + [PLACEHOLDER] + text(3, 6)
    image = picture(20, 20, seed=7)
    tokens, types, inputs = prepare_vl_inputs(prompt, [image], model.config)
    start = len(tokens) - w
    assert inputs[0].start < start < inputs[0].start + inputs[0].types.numel()
    engine = InferenceEngine(model, EngineConfig(max_num_seqs=1, max_model_len=128, prefill_chunk=chunk,
                                                 max_prefill_tokens=chunk, page_tokens=8, decoder_bounded_replay=True))
    _, result = run(engine, prompt, [image])
    seq = tokens + result.token_ids
    ids = torch.tensor([seq])
    mask = torch.tensor([[t != TEXT for t in types] + [False] * len(result.token_ids)])
    ctx = ForwardContext.create(ids, model.plan, image_mask=mask)
    ctx.swa_from = torch.tensor([start])
    with torch.no_grad():
        logits = model.head(*model.run_layers(model.embed(ids, images=[inputs]), ctx))[0][len(tokens) - 1:-1]
    assert result.token_ids == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(result.logprobs), ref, atol=1e-5)
