"""``POST /update_weights`` (disaggregated RL, issue 25): a server reloads the policy from a
checkpoint directory between two engine steps, its policy version becomes the request's, the next
generation equals the new weights' own, tokens of a request in flight across the reload carry the
version that produced each of them, and refusals name the field — for V4.1 and the Intern-S2 hybrid."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
import torch

from megatron_s2.inference.weights import load_model
from tests.serve.conftest import start_server

INTERN_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "intern_s2" / "pretrain_tiny.yaml"
PROMPT = [0, 30, 31, 32, 33, 34, 35, 36]
BODY = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "temperature": 1.0, "seed": 3, "logprobs": 1,
                                                   "ignore_eos": True}}


def _generate(url: str, body=BODY) -> dict:
    r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _reload_during_a_long_request(url: str, path, version: int):
    """(the reload's response, the policy version of each token of a 200-token request in flight across it)."""
    long = {**BODY, "sampling_params": {**BODY["sampling_params"], "max_tokens": 200}}
    result = {}
    thread = threading.Thread(target=lambda: result.update(_generate(url, long)))
    thread.start()
    r = httpx.post(f"{url}/update_weights", json={"path": str(path), "version": version}, timeout=120)
    thread.join()
    return r, result["policy_versions"]


def test_update_weights_reloads_between_steps_and_tags_versions(run_dir, loaded):
    reference = start_server(loaded)  # the checkpoint's own weights
    try:
        expected = _generate(reference.url)
    finally:
        reference.stop()
    perturbed = load_model(str(run_dir), "cpu")
    with torch.no_grad():
        for p in perturbed[0].parameters():
            p.add_(0.05 * torch.randn_like(p))
    server = start_server(perturbed)
    try:
        before = _generate(server.url)
        assert before["policy_versions"] == [0] * 8 and before["logprobs"] != expected["logprobs"]
        r = httpx.post(f"{server.url}/update_weights", json={"path": str(run_dir), "version": 3}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["policy_version"] == 3
        after = _generate(server.url)
        assert after["token_ids"] == expected["token_ids"] and after["policy_versions"] == [3] * 8
        got = [e["logprob"] for e in after["logprobs"]["content"]]
        want = [e["logprob"] for e in expected["logprobs"]["content"]]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5
        assert httpx.get(f"{server.url}/stats").json()["policy_version"] == 3

        # a request in flight across a reload: each token carries the version that produced it
        r, versions = _reload_during_a_long_request(server.url, run_dir, 4)
        assert r.status_code == 200 and versions == sorted(versions) and set(versions) <= {3, 4}

        # refusals: an older version (409), a missing path, no version
        r = httpx.post(f"{server.url}/update_weights", json={"path": str(run_dir), "version": 1})
        assert r.status_code == 409 and "older than the served policy version 4" in r.text
        r = httpx.post(f"{server.url}/update_weights", json={"path": str(run_dir / "nope"), "version": 5})
        assert r.status_code == 400 and "path:" in r.json()["error"]["message"]
        r = httpx.post(f"{server.url}/update_weights", json={"path": str(run_dir)})
        assert r.status_code == 400 and "version" in r.json()["error"]["message"]
        assert _generate(server.url)["policy_versions"] == [4] * 8  # the server serves on
    finally:
        server.stop()


def _logprobs(choice: dict) -> list[float]:
    return [e["logprob"] for e in choice["logprobs"]["content"]]


def test_a_checkpoint_that_does_not_fit_leaves_the_served_weights_untouched(run_dir, tmp_path):
    """A refused ``/update_weights`` changes nothing: every tensor's shape is checked before the
    first one is copied (a tensor that does not fit, found half-way through the copy, used to
    leave the server answering with half the old and half the new weights at the old version)."""
    from megatron_s2.checkpoint.hf.checkpoint_io import read_full_state, write_full_state

    model = load_model(str(run_dir), "cpu")
    full = read_full_state(run_dir)
    last = list(model[0].state_dict())[-1]
    state = {k: (v + 0.5 if v.is_floating_point() else v) for k, v in full.state.items()}
    state[last] = torch.cat([state[last], state[last][:1]])  # the last tensor copied: one row too many
    bad = write_full_state(state, full.recipe, tmp_path / "other", step=7)
    server = start_server(model)
    try:
        before = _generate(server.url)
        r = httpx.post(f"{server.url}/update_weights", json={"path": str(bad), "version": 5}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "path", r.text
        after = _generate(server.url)
        assert after["policy_versions"] == [0] * 8 and after["token_ids"] == before["token_ids"]
        assert _logprobs(after) == _logprobs(before)
    finally:
        server.stop()


def test_weights_of_another_architecture_are_refused_even_when_every_shape_fits(run_dir, tmp_path):
    """Same tensor shapes, another model: a different sliding window or routing top-k changes what
    the weights compute, so the server refuses them by name and keeps serving its own; a field
    only training reads (the router bias update rate, the init scale) is no reason to refuse."""
    from dataclasses import replace

    from megatron_s2.checkpoint.hf.checkpoint_io import read_full_state, write_full_state

    model = load_model(str(run_dir), "cpu")
    full = read_full_state(run_dir)
    cfg = full.recipe.model
    other = write_full_state(full.state, replace(full.recipe, model=replace(cfg, window_size=cfg.window_size * 2,
                                                                            moe_topk=cfg.moe_topk + 1)),
                             tmp_path / "other", step=7)
    retrained = write_full_state(full.state, replace(full.recipe, model=replace(
        cfg, moe_bias_update_rate=cfg.moe_bias_update_rate * 3, init_std=cfg.init_std / 2)), tmp_path / "rl", step=8)
    server = start_server(model)
    try:
        before = _generate(server.url)
        r = httpx.post(f"{server.url}/update_weights", json={"path": str(other), "version": 5}, timeout=120)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "path", r.text
        assert "another architecture" in error["message"] and "sliding_window" in error["message"]
        assert "num_experts_per_tok" in error["message"]
        after = _generate(server.url)
        assert after["policy_versions"] == [0] * 8 and _logprobs(after) == _logprobs(before)
        r = httpx.post(f"{server.url}/update_weights", json={"path": str(retrained), "version": 6}, timeout=120)
        assert r.status_code == 200 and r.json()["policy_version"] == 6, r.text
        again = _generate(server.url)
        assert again["policy_versions"] == [6] * 8 and again["token_ids"] == before["token_ids"]
    finally:
        server.stop()


# ---- the Intern-S2 family (issue 23: weight updates and serve work unchanged) ----------------------

@pytest.fixture(scope="module")
def intern_run(tmp_path_factory) -> Path:
    """A run directory of the tiny Intern-S2 hybrid: a committed checkpoint and its tokenizer."""
    from megatron_s2.checkpoint.hf.checkpoint_io import write_full_state
    from megatron_s2.config.recipe import load_recipe
    from megatron_s2.data.tokenizer import CharTokenizer
    from megatron_s2.data.tokenizer_checks import record_run_tokenizer
    from megatron_s2.models.family import family_of

    run = tmp_path_factory.mktemp("intern_serve") / "run"
    recipe = load_recipe(INTERN_RECIPE)
    write_full_state(family_of(recipe.model).build_model(recipe.model).init_weights(5).state_dict(), recipe,
                     run / "checkpoints", step=1)
    record_run_tokenizer(CharTokenizer(), run)
    return run


def test_intern_s2_weights_reload_between_steps_and_another_architecture_is_refused(intern_run, run_dir, tmp_path):
    """The hybrid's server: the reloaded weights give the checkpoint's own answer; a request in
    flight keeps its Gated DeltaNet states across a reload; weights of another architecture (same
    shapes: another top-k / rotary fraction, or the V4.1 family) are refused and the served ones
    kept; training-only keys (initializer_range, router_aux_loss_coef) are no reason to refuse."""
    from dataclasses import replace

    from megatron_s2.checkpoint.hf.checkpoint_io import read_full_state, write_full_state

    reference = start_server(load_model(str(intern_run), "cpu"), name="intern")
    try:
        expected = _generate(reference.url)
    finally:
        reference.stop()
    full = read_full_state(intern_run)
    cfg = full.recipe.model
    other = write_full_state(full.state, replace(full.recipe, model=replace(
        cfg, moe_topk=cfg.moe_topk + 1, partial_rotary_factor=2 * cfg.partial_rotary_factor)), tmp_path / "other", step=7)
    retrained = write_full_state(full.state, replace(full.recipe, model=replace(
        cfg, init_std=cfg.init_std / 2, router_aux_loss_coef=0.01)), tmp_path / "rl", step=8)
    perturbed = load_model(str(intern_run), "cpu")
    with torch.no_grad():
        for p in perturbed[0].parameters():
            p.add_(0.05 * torch.randn_like(p))
    server = start_server(perturbed, name="intern")
    try:
        before = _generate(server.url)
        assert before["policy_versions"] == [0] * 8 and _logprobs(before) != _logprobs(expected)
        r = httpx.post(f"{server.url}/update_weights", json={"path": str(intern_run), "version": 3}, timeout=120)
        assert r.status_code == 200 and r.json()["policy_version"] == 3, r.text
        after = _generate(server.url)
        assert after["token_ids"] == expected["token_ids"] and after["policy_versions"] == [3] * 8
        assert max(abs(a - b) for a, b in zip(_logprobs(after), _logprobs(expected))) < 1e-5

        # a request in flight across a reload (its recurrent states carry on under the new weights)
        r, versions = _reload_during_a_long_request(server.url, retrained, 4)
        assert r.status_code == 200, r.text
        assert len(versions) == 200 and versions == sorted(versions) and set(versions) <= {3, 4}
        served = _generate(server.url)
        assert served["policy_versions"] == [4] * 8 and _logprobs(served) == _logprobs(after)

        for path, names in ((other, ("num_experts_per_tok", "partial_rotary_factor")), (run_dir, ("'v41' model",))):
            r = httpx.post(f"{server.url}/update_weights", json={"path": str(path), "version": 5}, timeout=120)
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == "path", r.text
            assert all(name in error["message"] for name in names), error["message"]
        again = _generate(server.url)
        assert again["policy_versions"] == [4] * 8 and _logprobs(again) == _logprobs(served)
    finally:
        server.stop()
