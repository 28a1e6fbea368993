"""Visual next-patch pre-training (Intern-S2 walkthrough Ch. 3, Eq. 5–9): the raster scan with
the foreground mask, the contrastive loss against a float64 hand implementation, the Eq. (9)
combination, which parameters learn, and the chapter's worked numbers."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_s2.config.recipe import load_recipe
from megatron_s2.models.family import family_of
from megatron_s2.models.next_patch import NextPatchPredictor, foreground_mask, patchify, raster_scan
from megatron_s2.training.next_patch_objective import (VisualNextPatchObjective, next_patch_contrastive_loss,
                                                       next_patch_pairs)

PATCH = 4


def _page_from_ink(ink: torch.Tensor, patch: int = PATCH) -> torch.Tensor:
    """A white page [1, 3, rows*patch, cols*patch] whose patch (r, c) carries a dark stroke where
    ``ink[r, c]`` is set (a different pixel per patch, so latents differ)."""
    rows, cols = ink.shape
    page = torch.ones(1, 3, rows * patch, cols * patch)
    for r, c in ink.nonzero().tolist():
        k = (r * cols + c) % (patch * patch)
        page[0, :, r * patch + k // patch, c * patch + k % patch] = 0.0
        page[0, (r + c) % 3, r * patch, c * patch] = 0.3
    return page


def _journal_page_ink() -> torch.Tensor:
    """Worked example 8's page: a 48 x 36 patch grid with 605 blank patches (35% of 1,728) —
    margins top/bottom (4 rows each), left/right (2 columns each), four inter-paragraph rows and
    the short last lines of paragraphs."""
    ink = torch.ones(48, 36, dtype=torch.bool)
    ink[:4], ink[-4:], ink[:, :2], ink[:, -2:] = False, False, False, False
    for row in (12, 20, 28, 36):
        ink[row] = False
    for row, short in ((11, 8), (19, 8), (27, 8), (35, 5)):  # last paragraph lines end early
        ink[row, 34 - short:34] = False
    return ink


def test_worked_example_8_foreground_mask_savings():
    """Walkthrough, Worked example 8: "a patch grid of 48 x 36, so N = 1,728 patches ... margins
    ... run around 35% of the area" -> 1,123 patches kept, 605 discarded; "the attention work
    scales as (1,123 / 1,728)^2 = 0.4224 — about 42% of what the full grid would have cost ...
    You removed 35% of the tokens and 58% of the attention cost"."""
    ink = _journal_page_ink()
    assert ink.numel() == 1728 and round(0.35 * 1728) == 605
    patches = patchify(_page_from_ink(ink), PATCH)
    mask = foreground_mask(patches)
    u, valid = raster_scan(patches, mask)
    kept = int(valid.sum())
    assert (kept, 1728 - kept) == (1123, 605)
    # (1123 / 1728)^2 = 0.422349...: the walkthrough's 0.4224 is that figure rounded up in the last digit
    assert abs((kept / 1728) ** 2 - 0.4224) < 1e-4 and round((kept / 1728) ** 2, 2) == 0.42
    assert round(1 - (kept / 1728) ** 2, 2) == 0.58 and round((1728 - kept) / 1728, 2) == 0.35


def test_raster_scan_keeps_reading_order_and_drops_blank_paper():
    """Eq. (5): the survivors in raster order — left to right, top to bottom — left-packed, the
    padding zero and marked invalid; a blank page keeps nothing."""
    ink = torch.zeros(3, 4, dtype=torch.bool)
    ink[0, 3] = ink[1, 0] = ink[1, 2] = ink[2, 1] = True
    pages = torch.cat([_page_from_ink(ink), torch.ones(1, 3, 3 * PATCH, 4 * PATCH)])
    patches = patchify(pages, PATCH)
    assert patches.shape == (2, 12, 3 * PATCH * PATCH)
    mask = foreground_mask(patches)
    assert mask[0].nonzero().flatten().tolist() == [3, 4, 6, 9] and not mask[1].any()
    grid_index = torch.arange(12.0).view(1, 12, 1).expand(2, 12, 1)
    u, valid = raster_scan(grid_index, mask)
    assert u[0].flatten().tolist() == [3.0, 4.0, 6.0, 9.0] and valid[0].all()
    assert not valid[1].any() and (u[1] == 0).all()
    # paper that is off-white by less than the threshold is still paper
    assert not foreground_mask(patches[1:] - 0.05).any()


def _hand_loss(pred, target, tau: float) -> float:
    """Eq. (7)–(8) written out in float64 scalars."""
    m = len(pred)
    cos = [[sum(a * b for a, b in zip(p, t)) / math.sqrt(sum(a * a for a in p) * sum(b * b for b in t))
            for t in target] for p in pred]
    total = 0.0
    for i in range(m):
        s = [c / tau for c in cos[i]]
        top = max(s)
        total += -(s[i] - top - math.log(sum(math.exp(x - top) for x in s)))
    return total / m


@pytest.mark.parametrize("tau", [0.07, 0.5, 1.0])
def test_contrastive_loss_matches_a_float64_hand_implementation(tau):
    """L_VP = -1/M sum_t log softmax_j(cos(u_hat_{t+1}, u_{j+1}) / tau)[t] (Eq. 7–8): the label is
    the diagonal, every other pair of the batch a negative."""
    g = torch.Generator().manual_seed(3)
    pred, target = torch.randn(7, 5, generator=g), torch.randn(7, 5, generator=g)
    loss, _ = next_patch_contrastive_loss(pred, target, tau)
    want = _hand_loss(pred.double().tolist(), target.double().tolist(), tau)
    assert abs(float(loss) - want) < 1e-5 * max(1.0, want)


def test_contrastive_loss_limits():
    """A prediction equal to its own continuation with orthogonal negatives is picked with
    probability e^(1/tau) / (e^(1/tau) + M - 1); unrelated (identical) predictions score log M."""
    m, tau = 6, 0.5
    eye = torch.eye(m)
    loss, accuracy = next_patch_contrastive_loss(eye, eye, tau)
    assert math.isclose(float(loss), -math.log(math.exp(1 / tau) / (math.exp(1 / tau) + m - 1)), rel_tol=1e-5)
    assert float(accuracy) == 1.0
    same = torch.ones(m, m)
    assert math.isclose(float(next_patch_contrastive_loss(same, same, tau)[0]), math.log(m), rel_tol=1e-5)
    empty = torch.zeros(0, 4, requires_grad=True)
    assert float(next_patch_contrastive_loss(empty, empty, tau)[0].detach()) == 0.0


def test_pairs_never_score_padding_or_cross_pages():
    """Row t predicts latent t + 1 of the same page; a page's last kept patch predicts nothing,
    and padding is neither a prediction nor a target (the pseudo-code's pred[:, :-1] / u[:, 1:])."""
    pred = torch.arange(8.0).view(2, 4, 1)
    u = 100 + torch.arange(8.0).view(2, 4, 1)
    valid = torch.tensor([[True, True, True, False], [True, True, False, False]])
    p, t = next_patch_pairs(pred, u, valid)
    assert p.flatten().tolist() == [0.0, 1.0, 4.0] and t.flatten().tolist() == [101.0, 102.0, 105.0]


@pytest.fixture(scope="module")
def tiny_model():
    cfg = load_recipe("recipes/intern_s2/pretrain_tiny.yaml").model
    model = family_of(cfg).build_model(cfg).init_weights(0)
    model.next_patch = NextPatchPredictor(patch=PATCH, channels=3, latent_dim=16,
                                          hidden_size=cfg.hidden_size).init_weights(0)
    return model


def test_blank_patches_change_nothing(tiny_model):
    """The foreground mask excludes background patches: moving the ink to another page with more
    paper around it (same raster order of ink) gives the same sequence and the same loss."""
    ink = torch.zeros(4, 4, dtype=torch.bool)
    ink[1, 1] = ink[1, 2] = ink[2, 0] = ink[3, 3] = True
    wide = torch.zeros(4, 8, dtype=torch.bool)
    wide[:, :4] = ink
    small, large = _page_from_ink(ink), _page_from_ink(wide)
    # same pixels in the ink patches (the stroke position depends on the grid): copy them over
    large[..., :4 * PATCH] = small
    head = tiny_model.next_patch
    u1, v1 = head.scan(small, paper=1.0, threshold=0.1)
    u2, v2 = head.scan(large, paper=1.0, threshold=0.1)
    assert torch.equal(u1, u2) and torch.equal(v1, v2) and int(v1.sum()) == 4
    with torch.no_grad():
        l1 = next_patch_contrastive_loss(*next_patch_pairs(head.predict(tiny_model, u1), u1, v1), 0.1)[0]
        l2 = next_patch_contrastive_loss(*next_patch_pairs(head.predict(tiny_model, u2), u2, v2), 0.1)[0]
    assert float(l1) == float(l2)


def test_gradient_reaches_projection_backbone_and_head_not_the_frozen_encoder(tiny_model):
    """"The visual encoder remains frozen, while the LLM backbone, visual projection, and prediction
    head are optimized": L_VP sends gradient to W_in, psi and every backbone layer; E_v holds none."""
    tiny_model.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(0)
    pages = torch.ones(2, 3, 16, 16)
    pages[:, :, 4:12, 2:14] = torch.rand(2, 3, 8, 12, generator=g) * 0.5
    head = tiny_model.next_patch
    u, valid = head.scan(pages, paper=1.0, threshold=0.1)
    loss, _ = next_patch_contrastive_loss(*next_patch_pairs(head.predict(tiny_model, u), u, valid), 0.1)
    loss.backward()
    assert head.encoder.proj.weight.grad is None and not head.encoder.proj.weight.requires_grad
    for p in (head.w_in.weight, head.head.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    for i in tiny_model.layer_ids:
        grads = [p.grad for p in tiny_model.layers[str(i)].parameters() if p.grad is not None]
        assert grads and sum(float(g.abs().sum()) for g in grads) > 0, f"layer {i} got no gradient"
    # the text side is not in this loss: the token embedding and the vocabulary head get nothing
    assert tiny_model.embedding["word_embeddings"].weight.grad is None
    tiny_model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("lambdas", [(1.0, 1.0), (0.5, 2.0)])
def test_eq9_combines_text_and_visual_losses_with_their_weights(tiny_model, lambdas):
    """Eq. (9): L = lambda_text L_text + lambda_vis L_VP on one micro-batch of text and pages; the
    text term is its share of the global token mean, L_VP a per-micro-batch mean (1 of 2 here)."""
    lam_text, lam_vis = lambdas
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (2, 12), generator=g)
    mb = {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": torch.ones(2, 12),
          "pages": torch.where(torch.rand(2, 3, 16, 16, generator=g) > 0.6, 0.2, 1.0)}
    global_tokens = torch.tensor([48.0])  # this micro-batch and one like it on another rank
    objective = VisualNextPatchObjective(global_tokens, 2, lambda_text=lam_text, lambda_vis=lam_vis,
                                         temperature=0.1, paper=1.0, threshold=0.1)
    ctx = tiny_model.make_context(mb)
    with torch.no_grad():
        got, summed = objective(tiny_model, tiny_model(tokens, ctx), mb, ctx)
        text = tiny_model(tokens, labels=mb["labels"]).sum() / 48
        u, valid = tiny_model.next_patch.scan(mb["pages"], paper=1.0, threshold=0.1)
        vp, _ = next_patch_contrastive_loss(*next_patch_pairs(tiny_model.next_patch.predict(tiny_model, u), u,
                                                              valid), 0.1)
    assert torch.allclose(got, lam_text * text + lam_vis * vp / 2, rtol=1e-5)
    assert torch.allclose(summed / 48, lam_text * text + lam_vis * vp / 2, rtol=1e-5)
    assert torch.allclose(ctx.aux_metrics["loss_vp"], vp) and torch.allclose(ctx.aux_metrics["loss_text"] / 2, text)


# ---- the data path and the phase ----------------------------------------------------------------

def test_page_rows_are_scanned_chunked_and_deterministic():
    """A document's pages become kept patches in raster order, page after page (blank paper
    dropped), split into chunks of <= max_patches sharing chunk_overlap (the chunking rule); the
    stream depends on (seed, documents consumed) only, so a resumed stream continues exactly."""
    from megatron_s2.config.next_patch import VisualNextPatchConfig
    from megatron_s2.data.chunking import chunk_spans
    from megatron_s2.data.pages import PageDocuments, document_patches

    cfg = VisualNextPatchConfig(max_patches=32, chunk_overlap=4)
    stream = PageDocuments(cfg, seed=7, dp_rank=0, dp_size=1, micro_batches_per_rank=1)
    pages = stream.document(0)
    assert pages.shape == (2, 3, 64, 64)
    patches = patchify(pages, cfg.patch_size)
    mask = foreground_mask(patches, threshold=cfg.foreground_threshold)
    assert 0 < int(mask.sum()) < mask.numel()  # ink and paper on every page of the source
    sequence = document_patches(pages, cfg)
    assert torch.equal(sequence, torch.cat([patches[p][mask[p]] for p in range(2)]))
    mb = stream.rows([0])
    spans = chunk_spans(len(sequence), 32, 4)
    assert mb["patches"].shape == (len(spans), 32, 3 * 64) and len(spans) > 1
    for row, (a, b) in enumerate(spans):
        assert int(mb["patch_valid"][row].sum()) == b - a
        assert torch.equal(mb["patches"][row, :b - a], sequence[a:b])
    first = stream.next_step()
    state = stream.state_dict()
    second = stream.next_step()
    resumed = PageDocuments(cfg, seed=7, dp_rank=0, dp_size=1, micro_batches_per_rank=1)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next_step()[0]["patches"], second[0]["patches"])
    assert not torch.equal(first[0]["patches"][:1], second[0]["patches"][:1])


def _cli(*args: str):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megatron_s2.cli", *args], cwd=Path(__file__).resolve().parents[2],
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("override, words", [("phase.next_patch.page_size=60", "phase.next_patch.page_size"),
                                             ("phase.next_patch.chunk_overlap=64", "phase.next_patch.chunk_overlap"),
                                             ("phase.next_patch.temperature=0", "phase.next_patch.temperature"),
                                             ("parallel.pp=2", "parallel.pp=2"), ("parallel.cp=2", "parallel.cp=2")])
def test_settings_the_phase_cannot_use_are_refused_naming_the_field(override, words):
    from megatron_s2.config.schema import ConfigError
    from megatron_s2.training.run_checks import check_phase_layout

    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        check_phase_layout(load_recipe("recipes/visual_next_patch_tiny.yaml", [override]))


@pytest.mark.slow
@pytest.mark.parametrize("override, words", [("parallel.tp=2", "parallel.tp=2"), ("model=tiny", "model family 'v41'")])
def test_what_the_phase_cannot_run_is_refused_in_one_line(override, words, tmp_path):
    out = _cli("train", "recipes/visual_next_patch_tiny.yaml", f"training.run_dir={tmp_path / 'run'}", override)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.slow
def test_visual_next_patch_recipe_trains_with_falling_text_and_visual_losses(tmp_path):
    """``megatron-s2 train recipes/visual_next_patch_tiny.yaml``: the Eq. (9) loss falls, and so do
    both of its terms (averages of the first and last 8 of 40 steps), and the run checkpoints."""
    import json

    out = _cli("train", "recipes/visual_next_patch_tiny.yaml", f"training.run_dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))

    def drop(key: str) -> tuple[float, float]:
        return sum(r[key] for r in rows[:8]) / 8, sum(r[key] for r in rows[-8:]) / 8

    for r in rows:  # the logged loss is Eq. (9) with lambda_text = lambda_vis = 1
        assert math.isclose(r["loss"], r["loss_text_raw"] + r["loss_vp_raw"], rel_tol=1e-4)
    (text0, text1), (vp0, vp1) = drop("loss_text_raw"), drop("loss_vp_raw")
    assert text1 < text0 - 0.5, (text0, text1)
    assert vp1 < vp0 - 0.2, (vp0, vp1)
    assert (tmp_path / "run" / "checkpoints" / "step_00000040").is_dir()


@pytest.mark.slow
def test_the_phase_starts_from_a_text_checkpoint(tmp_path):
    """Continued pre-training: a text-only Intern-S2 checkpoint initialises the backbone (a new
    phase: checkpoint.load_optimizer=false), the visual pieces start from their initialisation, and
    the frozen encoder holds no optimiser state."""
    text = _cli("train", "recipes/intern_s2/pretrain_tiny.yaml", f"training.run_dir={tmp_path / 'text'}",
                "training.train_steps=2", "checkpoint.save_interval=2")
    assert text.returncode == 0, text.stderr[-3000:]
    out = _cli("train", "recipes/visual_next_patch_tiny.yaml", f"training.run_dir={tmp_path / 'vp'}",
               "training.train_steps=2", f"checkpoint.load={tmp_path / 'text' / 'checkpoints'}",
               "checkpoint.load_optimizer=false")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "3 tensors are not in" in out.stdout and "next_patch." in out.stdout
    assert "initialised from" in out.stdout


def test_a_step_trains_projection_head_and_backbone_and_leaves_the_encoder(tmp_path):
    """One optimiser step of the phase in process: W_in, psi and the backbone move, the frozen
    encoder is outside the optimiser and stays as drawn; the logged loss is Eq. (9)'s."""
    from megatron_s2.training.next_patch_trainer import VisualNextPatchTrainer

    recipe = load_recipe("recipes/visual_next_patch_tiny.yaml", [f"training.run_dir={tmp_path}",
                                                                  "training.train_steps=1"])
    trainer = VisualNextPatchTrainer(recipe, tmp_path, log=lambda *a, **k: None)
    head = trainer.model.next_patch
    optimised = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert id(head.encoder.proj.weight) not in optimised
    assert {id(head.w_in.weight), id(head.head.weight)} <= optimised
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    out = trainer.train_step()
    after = dict(trainer.model.named_parameters())
    assert torch.equal(before["next_patch.encoder.proj.weight"], after["next_patch.encoder.proj.weight"])
    for name in ("next_patch.w_in.weight", "next_patch.head.weight", "layers.0.input_norm.weight"):
        assert not torch.equal(before[name], after[name]), name
    assert math.isclose(out["loss"], out["extra"]["loss_text_raw"] + out["extra"]["loss_vp_raw"], rel_tol=1e-5)


_QUICK = ["training.train_steps=3", "training.seq_length=32", "checkpoint.save_interval=0", "checkpoint.save_at_end=false",
          "logging.progress_bar=false", "data.num_documents=500"]


def _dp_rank_losses(rank: int, world: int, out_dir: str) -> None:
    import json
    from pathlib import Path

    from megatron_s2.training.next_patch_trainer import VisualNextPatchTrainer

    run_dir = Path(out_dir) / f"run{world}"
    recipe = load_recipe("recipes/visual_next_patch_tiny.yaml", [*_QUICK, f"training.run_dir={run_dir}"])
    result = VisualNextPatchTrainer(recipe, run_dir, rank=rank, world_size=world, log=lambda *a, **k: None).train()
    if rank == 0:
        (Path(out_dir) / f"losses{world}.json").write_text(json.dumps(result.losses))


@pytest.mark.slow
def test_data_parallel_run_matches_one_rank(tmp_path):
    """DP2 sees the same micro-batches of text and pages as one rank (each rank its share, by
    global micro-batch index), so three steps give the same Eq. (9) losses."""
    import json

    from tests.parallel.spawn import run_distributed

    torch.set_num_threads(1)
    _dp_rank_losses(0, 1, str(tmp_path))
    run_distributed(2, _dp_rank_losses, str(tmp_path))
    one, two = (json.loads((tmp_path / f"losses{w}.json").read_text()) for w in (1, 2))
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        assert math.isclose(a, b, rel_tol=2e-5), (one, two)
