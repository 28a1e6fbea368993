"""How far fp32 reduction-order noise alone moves each gradient of the single-rank parity run.

A parallel layout sums the same numbers in a different order (all-reduces, reduce-scatters,
split matmuls), which perturbs activations by ~1e-7 relative. This script injects exactly that
— every MoE layer's output multiplied by ``1 + eps * N(0, 1)`` — into the single-rank reference
of :mod:`tests.parallel.parity` and reports, per gradient tensor, the largest relative change
over several noise seeds (same scale convention as ``assert_close``: the tensor's largest
magnitude, floored at ``grad_floor`` x the model's largest gradient). Tensors whose envelope
reaches the parity tolerance get a documented carve-out in parity.py.

    python -m tests.parallel.noise_envelope [--eps 1e-7] [--seeds 10] [--top 12]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from megatron_s2.config.recipe import load_recipe
from megatron_s2.models.v41.moe import MoELayer
from tests.parallel.parity import BASE, RECIPE, TOLERANCES


def envelope(eps: float, seeds: int) -> dict[str, float]:
    from megatron_s2.training.trainer import Trainer

    run_dir = Path(tempfile.mkdtemp()) / "run"
    trainer = Trainer(load_recipe(RECIPE, [*BASE, f"training.run_dir={run_dir}"]), run_dir, log=lambda *a, **k: None)
    micro_batches = trainer.data.next_step()
    noise: dict[str, torch.Generator | None] = {"gen": None}

    def perturb(module, args, out):
        gen = noise["gen"]
        return out if gen is None else out * (1 + eps * torch.randn(out.shape, generator=gen, dtype=out.dtype))

    for module in trainer.model.modules():
        if isinstance(module, MoELayer):
            module.register_forward_hook(perturb)

    def grads(seed: int | None) -> dict[str, torch.Tensor]:
        noise["gen"] = None if seed is None else torch.Generator().manual_seed(seed)
        trainer.model.zero_grad(set_to_none=True)
        trainer.compute_gradients([dict(mb) for mb in micro_batches])
        return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    ref = grads(None)
    floor = TOLERANCES["grad_floor"] * max(float(g.abs().max()) for g in ref.values())
    worst: dict[str, float] = {}
    for seed in range(seeds):
        for name, g in grads(seed).items():
            scale = max(float(ref[name].abs().max()), floor)
            worst[name] = max(worst.get(name, 0.0), float((g - ref[name]).abs().max()) / scale)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eps", type=float, default=1e-7)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    worst = envelope(args.eps, args.seeds)
    print(f"largest relative gradient change over {args.seeds} seeds of {args.eps:g} noise on MoE outputs "
          f"(parity tolerance {TOLERANCES['grad_rtol']:g}):")
    for name, err in sorted(worst.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {err:.2e}  {name}")


if __name__ == "__main__":
    main()
