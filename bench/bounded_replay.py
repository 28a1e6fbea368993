"""SWA Bounded Replay (report §3.2.2): logit KL against the exact state and prefill FLOPs
against a full prefill, on the tiny and small models (random weights unless a checkpoint is
given — the KL of random weights says little about a trained model's; the FLOPs ratio does
not depend on the weights).

Variants (see :mod:`megatron_s2.tools.replay_report`): Decoder SWA Bounded Replay (decoder
over the last W prompt tokens), Encoder SWA Bounded Replay (a cached global-KV prefix, SWA
state missing: the last W prefix tokens replayed with the suffix), and both.

    python bench/bounded_replay.py                     # tiny and small, default lengths
    python bench/bounded_replay.py --models tiny --prompt 256 --cached 192 --continuation 16
    python bench/bounded_replay.py --smoke             # seconds: tiny, short prompt
    python bench/bounded_replay.py --checkpoint runs/x # a trained model instead

A second table is the RL side (issue 14): rollouts sampled by an engine with Decoder SWA
Bounded Replay on 6-digit additions (prompts longer than the tiny model's window), and the
per-token |log p| gap between the engine and the training forward with the train-aware
simulation (``rl.rollout.engine.train_aware_replay``) and without it
(:mod:`megatron_s2.posttrain.rollout.replay_mismatch`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_s2.tools.replay_report import measure_bounded_replay  # noqa: E402
from megatron_s2.models.v41.model import build_model  # noqa: E402
from tests.models.conftest import load_model_recipe  # noqa: E402


def model_for(name: str, checkpoint: str | None):
    if checkpoint:
        from megatron_s2.inference.weights import load_model

        return load_model(checkpoint)[0]
    cfg = load_model_recipe(name)
    return build_model(cfg.replace(init_std=0.02), seed=0).eval()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--prompt", type=int, default=0, help="prompt tokens (default: 8 windows)")
    ap.add_argument("--cached", type=int, default=0, help="cached-prefix tokens (default: 3/4 of the prompt)")
    ap.add_argument("--continuation", type=int, default=16)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = ["tiny"] if args.smoke else args.models
    print(f"{'model':8s} {'variant':16s} {'KL mean':>10s} {'KL max':>10s} {'prefill GFLOP':>14s} {'vs full':>8s}")
    for name in models:
        model = model_for(name, args.checkpoint)
        w = model.config.window_size
        prompt_len = args.prompt or (4 * w if args.smoke else 8 * w)
        cached = args.cached or prompt_len * 3 // 4
        cont = 4 if args.smoke else args.continuation
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(5, min(model.config.vocab_size, 1000), (prompt_len + cont,), generator=g).tolist()
        t0 = time.perf_counter()
        rows = measure_bounded_replay(model, tokens[:prompt_len], tokens[prompt_len:], cached_prefix=cached,
                                      page_tokens=16, chunk=min(256, prompt_len))
        for m in rows:
            print(f"{name:8s} {m.variant:16s} {m.kl_mean:10.2e} {m.kl_max:10.2e} {m.prefill_flops / 1e9:14.3f} "
                  f"{m.flops_ratio:8.3f}")
        print(f"{name:8s} (prompt {prompt_len}, cached prefix {cached}, window {w}, continuation {cont}; "
              f"{time.perf_counter() - t0:.1f} s)")
    train_aware_table(args)
    return 0


def train_aware_table(args) -> None:
    from megatron_s2.config.data import TaskDifficulty
    from megatron_s2.data.tokenizer import CharTokenizer
    from megatron_s2.config.posttrain.environment import EnvironmentConfig
    from megatron_s2.posttrain.envs import TaskEnvironment
    from megatron_s2.posttrain.rollout.replay_mismatch import measure_replay_mismatch

    if args.checkpoint:
        from megatron_s2.inference.weights import load_model

        model, tokenizer = load_model(args.checkpoint)[:2]
    else:
        model, tokenizer = model_for("tiny", None), CharTokenizer()
    count = 4 if args.smoke else 32
    env = TaskEnvironment("add", EnvironmentConfig(kind="task", task="addition", num_prompts=count, eval_prompts=1,
                                                   difficulty=TaskDifficulty(addition_max_digits=6)), tokenizer)
    t0 = time.perf_counter()
    r = measure_replay_mismatch(model, env, "add", count, max_new_tokens=8, max_model_len=48,
                                eos_ids=[tokenizer.eos_id])
    print(f"\n{'trainer forward':26s} {'|dlogp| mean':>13s} {'|dlogp| max':>12s}   (engine: decoder bounded replay)")
    print(f"{'train-aware replay on':26s} {r.with_mean:13.2e} {r.with_max:12.2e}")
    print(f"{'train-aware replay off':26s} {r.without_mean:13.2e} {r.without_max:12.2e}")
    print(f"({r.samples} rollouts with prompts beyond the window, {r.tokens} sampled tokens, 6-digit additions, window "
          f"{model.config.window_size}; {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    sys.exit(main())
