"""Speculative decoding with the DSpark drafter (report §2.4.3): tokens/s with and without
speculation, side by side in one run, and what the drafter achieved.

One model (a checkpoint with a drafter, e.g. after ``recipes/dspark_tiny.yaml``) and two
engines over it — plain decode, and ``speculative: true`` — generate the same prompts (problems
of the synthetic tasks the checkpoint's run trained on, rendered as chat prompts; a request ends
at its end-of-sequence token or ``--max-tokens``). Rounds alternate the two engines so both
see the same machine load (this machine is noisy); reported per (batch, sampling): median
tokens/s over rounds, the ratio speculative / plain, acceptance per draft position, and tokens
per verification round. Greedy outputs are also checked to be identical (speculation is exact).

    python bench/speculative.py runs/dspark_tiny/dspark --batches 1 4 --rounds 5
    python bench/speculative.py --smoke            # a random tiny drafter, seconds, no figures
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _smoke_model():
    import yaml

    from megatron_s2.config.schema import from_mapping
    from megatron_s2.data.tokenizer import CharTokenizer
    from megatron_s2.models.v41.config import V41Config
    from megatron_s2.models.v41.model import build_model

    raw = yaml.safe_load((REPO / "recipes" / "models" / "tiny.yaml").read_text())
    raw.update(dspark_layers=2, dspark_block_size=4, dspark_noise_token_id=127, dspark_target_layer_ids=[5, 6, 7],
               dspark_markov_rank=8, dspark_num_routed_experts=4, dspark_moe_topk=2)
    return build_model(from_mapping(V41Config, raw, "model"), seed=0).eval(), CharTokenizer()


def _tasks(checkpoint: str | None):
    """The synthetic tasks the checkpoint's run trained on (its config.yaml), else sort + copy."""
    from megatron_s2.config.data import TaskDifficulty
    from megatron_s2.data.tasks import build_tasks

    names, difficulty = ["sort", "copy"], TaskDifficulty(sort_max_length=24, string_max_length=24)
    if checkpoint:  # a run, checkpoints or step directory: the run's config.yaml is at or above it
        import yaml

        path = Path(checkpoint).resolve()
        found = next((d / "config.yaml" for d in (path, path.parent, path.parent.parent)
                      if (d / "config.yaml").is_file()), None)
        data = (yaml.safe_load(found.read_text()) or {}).get("data", {}) if found else {}
        if data.get("tasks"):
            names, difficulty = data["tasks"], TaskDifficulty(**data.get("difficulty", {}))
    return build_tasks(names, difficulty)


def _prompts(tokenizer, tasks, count: int, seed: int) -> list[list[int]]:
    from megatron_s2.data.documents import render_prompt_answer

    rng = random.Random(seed)
    out = []
    for i in range(count):
        ids, prompt_len = render_prompt_answer(tokenizer, tasks[i % len(tasks)].sample(rng).prompt, "")
        out.append([int(t) for t in ids[:prompt_len]])
    return out


def _run(engine, prompts, params) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    done = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return sum(len(r.token_ids) for r in done) / seconds, [r.token_ids for r in done]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", nargs="?", help="run / checkpoints / step directory of a model with a drafter")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="requests per batch slot in a round (default 4)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--schedule", choices=["confidence", "fixed"], default="confidence")
    ap.add_argument("--smoke", action="store_true", help="random tiny drafter, one short round (no figures)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from megatron_s2.config.engine import EngineConfig
    from megatron_s2.inference.engine import InferenceEngine
    from megatron_s2.inference.sampling import SamplingParams

    if args.smoke:
        model, tokenizer = _smoke_model()
        args.batches, args.max_tokens, args.rounds, args.requests = [1, 2], 8, 1, 1
        what = "tiny, random drafter (smoke: no figures)"
    else:
        if not args.checkpoint:
            ap.error("give a checkpoint with a DSpark drafter, or --smoke")
        from megatron_s2.inference.weights import load_model

        model, tokenizer, what = load_model(args.checkpoint, "cpu")
        if getattr(model, "dspark", None) is None:
            print(f"{args.checkpoint}: the model has no DSpark drafter (model.dspark_layers: 0)", file=sys.stderr)
            return 2
    tasks = _tasks(None if args.smoke else args.checkpoint)
    print(f"model: {what}; tasks {', '.join(t.name for t in tasks)}; {args.threads} thread(s); "
          f"max_tokens {args.max_tokens}; schedule {args.schedule}")
    header = (f"{'batch':>5} {'sampling':>8} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} "
              f"{'tok/round':>9}  acceptance per position")
    print(header)
    for batch in args.batches:
        prompts = _prompts(tokenizer, tasks, batch * args.requests, seed=batch)
        cfg = dict(max_num_seqs=batch, max_model_len=256, page_tokens=16, prefill_chunk=64, max_prefill_tokens=256)
        for sampling, params in (("greedy", SamplingParams(max_tokens=args.max_tokens, temperature=0.0)),
                                 ("t=1", SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=7))):
            plain = InferenceEngine(model, EngineConfig(**cfg))
            spec = InferenceEngine(model, EngineConfig(**cfg, speculative=True, speculative_schedule=args.schedule))
            rates = {"plain": [], "spec": []}
            for _ in range(args.rounds):  # alternate: both see the same load
                rate_p, out_p = _run(plain, prompts, params)
                rate_s, out_s = _run(spec, prompts, params)
                rates["plain"].append(rate_p)
                rates["spec"].append(rate_s)
                if sampling == "greedy" and out_p != out_s:
                    print("greedy speculative output differs from plain greedy decode", file=sys.stderr)
                    return 1
            stats = spec.stats()["speculative"]
            p, s = statistics.median(rates["plain"]), statistics.median(rates["spec"])
            per_pos = " ".join(f"{a:.2f}" for a in stats["acceptance_per_position"])
            print(f"{batch:>5} {sampling:>8} {p:>12.1f} {s:>11.1f} {s / p:>6.2f} {stats['tokens_per_round']:>9.2f}"
                  f"  {per_pos}")
    print("ratio = speculative / plain tokens per second (> 1: speculation is faster); tok/round = tokens "
          "emitted per verification (accepted drafts + 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
