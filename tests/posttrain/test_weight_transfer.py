"""Co-located weight transfer (megatron_s2/posttrain/rollout/weights.py): training shards under
TP2 x PP2, CP2 x TP2, PP4 and CP2 x Engram-parallel 2 on four gloo ranks -> a TP/EP rollout model on the same ranks, in
memory. The training parameters are first moved away from their initialisation by a known,
layout-independent delta (as an optimiser step would), so the rollout model must end up with
init + delta sliced for its own layout; a second transfer after another change follows it.
"""

from __future__ import annotations

import pytest
import torch

from megatron_s2.config.recipe import load_recipe
from megatron_s2.models.v41.model import V41Model
from megatron_s2.parallel.sharding import name_seed, shard_spec, slice_of
from tests.parallel.spawn import run_distributed

RECIPE = "recipes/phases/rl_addition.yaml"
LAYOUTS = {
    "tp2_pp2": ["parallel.tp=2", "parallel.pp=2"],
    "cp2_tp2": ["parallel.cp=2", "parallel.tp=2"],
    "pp4_ep": ["parallel.pp=4", "rl.rollout.engine.rollout_ep=2"],
    "cp2_engram2": ["parallel.cp=2", "parallel.engram_parallel=2"],  # the rollout model keeps the Engram partition
}
SEED = 1234


def delta(name: str, shape, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(name_seed(SEED + k, name))
    return 0.01 * torch.randn(shape, generator=g)


def _worker(rank, world, out_dir):
    from megatron_s2.parallel.layout import ParallelLayout
    from megatron_s2.parallel.setup import build_groups
    from megatron_s2.parallel.rollout_layout import rollout_placement
    from megatron_s2.posttrain.rollout.weights import WeightTransfer
    from megatron_s2.training.model_builder import build_stage_model

    for name, overrides in LAYOUTS.items():
        recipe = load_recipe(RECIPE, overrides + ["training.seq_length=32"])
        t = recipe.training
        layout = ParallelLayout.build(recipe.parallel, recipe.model, world, seq_length=t.seq_length,
                                      global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size)
        groups = build_groups(layout)
        model, _ = build_stage_model(recipe, layout, groups, rank)
        placement = rollout_placement(recipe, layout, world)
        assert not placement.shared
        assert placement.layout.engram == recipe.parallel.engram_parallel
        rollout = V41Model(recipe.model, build_groups(placement.layout))
        transfer = WeightTransfer(model, rollout, rank=rank, world_size=world)
        results = {}
        for k in (1, 2):  # two updates: the rollout model follows each
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    spec = shard_spec(p)
                    p.add_(slice_of(delta(pname, spec.full_shape, k), spec).to(p.dtype))
            transfer()
            results[k] = {n: ([(a.start, a.stop) for a in shard_spec(t).slices()], t.detach().clone()) for n, t in
                          rollout.state_dict(keep_vars=True).items()}
        torch.save(results, f"{out_dir}/{name}_rank{rank}.pt")


@pytest.fixture(scope="module")
def transferred(tmp_path_factory):
    out = tmp_path_factory.mktemp("transfer")
    run_distributed(4, _worker, str(out))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rollout_model_receives_the_training_weights(transferred, layout):
    recipe = load_recipe(RECIPE)
    model = V41Model(recipe.model).init_weights(SEED)
    reference, params = model.state_dict(), dict(model.named_parameters())
    for rank in range(4):
        results = torch.load(transferred / f"{layout}_rank{rank}.pt")
        for k, state in results.items():
            assert set(state) == set(reference)
            for name, (slices, local) in state.items():
                want = reference[name].float()
                if name in params:
                    want = want + sum(delta(name, want.shape, j) for j in range(1, k + 1))
                torch.testing.assert_close(local.float(), want[tuple(slice(a, b) for a, b in slices)], rtol=0, atol=1e-6, msg=f"{layout} {name} k={k}")
