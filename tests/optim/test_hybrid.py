"""HybridOptimizer: lr multipliers, stepping every family, exact state_dict round trip, clipping."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from optim_toy_model import ToyV41, fill_grads

from megatron_s2.config.optimizer import OptimizerConfig
from megatron_s2.optim import build_optimizer, clip_grad_norm_


def _train(model: torch.nn.Module, opt, seeds, lr: float = 1e-2) -> None:
    for seed in seeds:
        fill_grads(model, seed)
        opt.set_lr(lr)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_sub_optimisers_and_lr_multipliers(toy_model):
    opt = build_optimizer(toy_model, OptimizerConfig())
    assert set(opt.optimizers) == {"muon", "sinkhorn", "adamw"}
    assert isinstance(opt.optimizers["adamw"], torch.optim.AdamW)
    opt.set_lr(2e-4)
    by_rule = {group["rule"]: group for group in opt.param_groups}
    assert by_rule["*engram.table.weight"]["lr"] == pytest.approx(1e-3)
    assert by_rule["embedding.word_embeddings.weight"]["lr"] == pytest.approx(2e-4)
    assert by_rule["*norm*.weight"]["weight_decay"] == 0.1 and by_rule["*.bias"]["weight_decay"] == 0.0
    assert by_rule["*.linear_q_up.weight"]["head_split"] == 3
    assert by_rule["*.indexer.linear_q.weight"]["head_split"] == 2
    adamw = opt.optimizers["adamw"].param_groups[0]
    assert adamw["betas"] == (0.9, 0.95) and adamw["eps"] == 1e-20
    # Every trainable parameter sits in exactly one group.
    grouped = [p for group in opt.param_groups for p in group["params"]]
    assert len(grouped) == len({id(p) for p in grouped}) == len(list(toy_model.parameters()))


def test_step_requires_set_lr(toy_model):
    opt = build_optimizer(toy_model, OptimizerConfig())
    fill_grads(toy_model, 0)
    with pytest.raises(RuntimeError, match="set_lr"):
        opt.step()


def test_every_family_updates_and_frozen_parameters_stay(toy_model):
    frozen = toy_model.decoder.layers[1].self_attention.linear_q_down.weight
    frozen.requires_grad_(False)
    before = {name: p.detach().clone() for name, p in toy_model.named_parameters()}
    opt = build_optimizer(toy_model, OptimizerConfig())
    _train(toy_model, opt, seeds=[1])
    after = dict(toy_model.named_parameters())
    assert torch.equal(after["decoder.layers.1.self_attention.linear_q_down.weight"], frozen.detach())
    assert torch.equal(before["decoder.layers.1.self_attention.linear_q_down.weight"], frozen.detach())
    for name in ["embedding.word_embeddings.weight", "decoder.layers.0.engram.table.weight",
                 "decoder.layers.0.self_attention.linear_q_up.weight", "decoder.layers.0.experts.weight1",
                 "decoder.layers.0.hc.base", "decoder.final_layernorm.weight"]:
        assert not torch.equal(before[name], after[name].detach()), name


def test_state_dict_round_trip_resumes_bit_identically():
    cfg = OptimizerConfig()
    torch.manual_seed(0)
    model_a = ToyV41()
    opt_a = build_optimizer(model_a, cfg)
    _train(model_a, opt_a, seeds=[1, 2, 3])
    saved_opt = _roundtrip(opt_a.state_dict())
    saved_model = copy.deepcopy(model_a.state_dict())
    _train(model_a, opt_a, seeds=[4, 5])

    def resumed(load_state: bool) -> ToyV41:
        torch.manual_seed(123)
        model = ToyV41()
        model.load_state_dict(saved_model)
        opt = build_optimizer(model, cfg)
        if load_state:
            opt.load_state_dict(saved_opt)
        _train(model, opt, seeds=[4, 5])
        return model

    model_b = resumed(load_state=True)
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), name
    # Without the optimiser state (momenta, Adam moments, step counts) the run diverges.
    model_c = resumed(load_state=False)
    assert any(not torch.equal(a, c) for a, c in zip(model_a.parameters(), model_c.parameters()))


def test_resume_keeps_this_runs_hyper_parameters_and_the_saved_lr(toy_model):
    opt = build_optimizer(toy_model, OptimizerConfig())
    _train(toy_model, opt, seeds=[1], lr=3e-3)
    state = _roundtrip(opt.state_dict())
    resumed = build_optimizer(toy_model, OptimizerConfig(muon_weight_decay=0.0, momentum=0.9))
    resumed.load_state_dict(state)
    muon = resumed.optimizers["muon"].param_groups
    assert all(g["weight_decay"] == 0.0 and g["momentum"] == 0.9 and g["lr"] == 3e-3 for g in muon)
    resumed.step()  # learning rates restored: no set_lr needed before the first resumed step


def test_load_state_dict_rejects_a_different_model(toy_model):
    opt = build_optimizer(toy_model, OptimizerConfig())
    _train(toy_model, opt, seeds=[1])
    state = _roundtrip(opt.state_dict())
    renamed = ToyV41()
    renamed.decoder.layers[0].self_attention.register_parameter("attn_sink", None)
    renamed.decoder.layers[0].self_attention.q_attn_sink = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"q_attn_sink.* where the checkpoint has .*\.attn_sink"):
        build_optimizer(renamed, OptimizerConfig()).load_state_dict(state)
    no_sinkhorn = ToyV41()
    for module in (no_sinkhorn.embedding.word_embeddings, no_sinkhorn.output_layer,
                   no_sinkhorn.decoder.layers[0].engram.table):
        module.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="sub-optimisers"):
        build_optimizer(no_sinkhorn, OptimizerConfig()).load_state_dict(state)


def test_clip_grad_norm_scales_to_max_norm_in_float32():
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
    a.grad = torch.tensor([3.0, 0.0])
    b.grad = torch.tensor([4.0], dtype=torch.bfloat16)
    total = clip_grad_norm_([a, b], max_norm=1.0)
    assert total.dtype == torch.float32 and total.item() == 5.0
    torch.testing.assert_close(a.grad, torch.tensor([0.6, 0.0]), atol=1e-6, rtol=0)
    assert b.grad.item() == pytest.approx(0.8, abs=4e-3)  # bfloat16 resolution


def test_clip_grad_norm_leaves_small_zero_threshold_and_nonfinite_alone():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([0.3, 0.4])
    assert clip_grad_norm_([p], max_norm=1.0).item() == pytest.approx(0.5)
    assert torch.equal(p.grad, torch.tensor([0.3, 0.4]))
    p.grad = torch.tensor([30.0, 40.0])
    assert clip_grad_norm_([p], max_norm=0.0).item() == pytest.approx(50.0)
    assert torch.equal(p.grad, torch.tensor([30.0, 40.0]))
    p.grad = torch.tensor([float("inf"), 1.0])
    assert not torch.isfinite(clip_grad_norm_([p], max_norm=1.0))
    assert p.grad[1].item() == 1.0
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_([p], max_norm=-1.0)


def test_clip_grad_norm_is_deterministic(toy_model):
    fill_grads(toy_model, 7)
    first = clip_grad_norm_(toy_model.parameters(), max_norm=0.0)
    second = clip_grad_norm_(toy_model.parameters(), max_norm=0.0)
    assert torch.equal(first, second)
    expected = torch.cat([p.grad.flatten().double() for p in toy_model.parameters()]).norm()
    assert first.item() == pytest.approx(expected.item(), rel=1e-6)
