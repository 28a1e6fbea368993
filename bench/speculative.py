"""Speculative decoding with the DSpark drafter (report 003 §2.4.3): tokens/s with and without
speculation, side by side in one run, and what the drafter achieved.

One model (a checkpoint with a drafter, e.g. after ``recipes/dspark_tiny.yaml``) and three
engines over it — plain decode; ``speculative: true`` with the adaptive schedule (it drafts only
while drafting pays at the current batch size, measured, and otherwise decodes plainly, probing
with exponential back-off: ``megatron_s2/inference/speculation_schedule.py``); and
``speculative_schedule: fixed``, which drafts at every step and verifies every draft (what a
schedule that trusts its drafter does) — generate the same prompts (problems of the synthetic
tasks the checkpoint's run trained on, rendered as chat prompts; a request ends at its
end-of-sequence token or ``--max-tokens``). Rounds alternate the engines so all see the same
machine load (this machine is noisy); reported per (batch, sampling, drafter): median tokens/s
over rounds, the ratios to plain (wall time, and for the adaptive engine also the process's CPU
time, which other jobs on a shared machine disturb less), the adaptive engine's decode steps that
drafted, tokens per verification round and acceptance per draft position. Greedy outputs are
also checked to be identical (speculation is exact).

``--oracle`` adds rows with a drafter that proposes the target's own greedy continuation
(recorded from the plain engine; greedy only): every draft is accepted, at the real drafter's
cost — what a well-trained drafter approaches.

    python bench/speculative.py runs/dspark_tiny/dspark --batches 1 16 --rounds 5
    python bench/speculative.py --random --oracle     # the tiny backbone with a random drafter
    python bench/speculative.py --smoke               # the same, seconds, no figures
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


def _run(engine, prompts, params) -> tuple[float, float, list[list[int]]]:
    """(tokens/s of wall time, tokens/s of this process's CPU time, the outputs)."""
    wall, cpu = time.perf_counter(), time.process_time()
    done = engine.generate(prompts, params)
    tokens = sum(len(r.token_ids) for r in done)
    return (tokens / (time.perf_counter() - wall), tokens / max(time.process_time() - cpu, 1e-9),
            [r.token_ids for r in done])


def _row(model, prompts, params, cfg, rounds: int, oracle: bool) -> dict | None:
    """Alternating rounds of the three engines; None when greedy outputs differ."""
    from megatron_s2.config.engine import EngineConfig
    from megatron_s2.inference.engine import InferenceEngine
    from megatron_s2.inference.oracle_drafter import GreedyOracle

    engines = {"plain": InferenceEngine(model, EngineConfig(**cfg)),
               "adaptive": InferenceEngine(model, EngineConfig(**cfg, speculative=True)),
               "always": InferenceEngine(model, EngineConfig(**cfg, speculative=True, speculative_schedule="fixed"))}
    if oracle:
        truth = {tuple(p): p + r.token_ids for p, r in zip(prompts, engines["plain"].generate(prompts, params))}
        for name in ("adaptive", "always"):
            engines[name].speculator.drafter = GreedyOracle(engines[name].executor.drafter, truth)
    wall = {name: [] for name in engines}
    cpu = {name: [] for name in engines}
    for _ in range(rounds):  # alternate: all see the same load
        outputs = {}
        for name, engine in engines.items():
            rate, cpu_rate, outputs[name] = _run(engine, prompts, params)
            wall[name].append(rate)
            cpu[name].append(cpu_rate)
        if params.greedy and not outputs["plain"] == outputs["adaptive"] == outputs["always"]:
            return None
    median = {name: statistics.median(rates) for name, rates in wall.items()}
    adaptive = engines["adaptive"].stats()["speculative"]
    return {"wall": median, "cpu_ratio": statistics.median(cpu["adaptive"]) / statistics.median(cpu["plain"]),
            "drafting": f"{adaptive['speculative_steps']}/{adaptive['speculative_steps'] + adaptive['plain_steps']}",
            "always": engines["always"].stats()["speculative"], "adaptive": adaptive}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", nargs="?", help="run / checkpoints / step directory of a model with a drafter")
    ap.add_argument("--random", action="store_true", help="the tiny backbone with a random drafter instead")
    ap.add_argument("--oracle", action="store_true", help="also a drafter of the target's own greedy tokens")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2, help="requests per batch slot in a round (default 2)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="random tiny drafter and the oracle, one short round "
                                                          "(no figures)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from megatron_s2.inference.sampling import SamplingParams

    if args.smoke:
        args.random = args.oracle = True
        args.max_tokens, args.rounds, args.requests = 8, 1, 1
    if args.random:
        model, tokenizer = _smoke_model()
        what = "tiny, random drafter" + (" (smoke: no figures)" if args.smoke else "")
    else:
        if not args.checkpoint:
            ap.error("give a checkpoint with a DSpark drafter, or --random / --smoke")
        from megatron_s2.inference.weights import load_model

        model, tokenizer, what = load_model(args.checkpoint, "cpu")
        if getattr(model, "dspark", None) is None:
            print(f"{args.checkpoint}: the model has no DSpark drafter (model.dspark_layers: 0)", file=sys.stderr)
            return 2
    tasks = _tasks(None if args.random else args.checkpoint)
    print(f"model: {what}; tasks {', '.join(t.name for t in tasks)}; {args.threads} thread(s); "
          f"max_tokens {args.max_tokens}; {args.requests} request(s) per batch slot; median of {args.rounds} round(s)")
    print(f"{'batch':>5} {'sampling':>8} {'drafter':>7} {'plain tok/s':>12} {'adaptive':>9} {'ratio':>6} "
          f"{'cpu ratio':>9} {'always':>8} {'ratio':>6} {'drafting steps':>14} {'tok/round':>9}  acceptance per position")
    for batch in args.batches:
        prompts = _prompts(tokenizer, tasks, batch * args.requests, seed=batch)
        cfg = dict(max_num_seqs=batch, max_model_len=256, page_tokens=16, prefill_chunk=64, max_prefill_tokens=256)
        greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        rows = [("greedy", greedy, "model"), ("t=1", SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=7),
                                               "model")]
        if args.oracle:
            rows.append(("greedy", greedy, "oracle"))
        for sampling, params, drafter in rows:
            row = _row(model, prompts, params, cfg, args.rounds, oracle=drafter == "oracle")
            if row is None:
                print("greedy speculative output differs from plain greedy decode", file=sys.stderr)
                return 1
            wall, stats = row["wall"], row["always"]
            per_pos = " ".join(f"{a:.2f}" for a in stats["acceptance_per_position"])
            print(f"{batch:>5} {sampling:>8} {drafter:>7} {wall['plain']:>12.1f} {wall['adaptive']:>9.1f} "
                  f"{wall['adaptive'] / wall['plain']:>6.2f} {row['cpu_ratio']:>9.2f} {wall['always']:>8.1f} "
                  f"{wall['always'] / wall['plain']:>6.2f} {row['drafting']:>14} {stats['tokens_per_round']:>9.2f}"
                  f"  {per_pos}")
    print("ratio = speculative / plain tokens per second (> 1: speculation is faster); adaptive: drafts only while "
          "drafting pays (its decode steps that drafted: drafting steps); always: drafts and verifies every draft at "
          "every step (its tok/round = tokens per verification, and acceptance per position)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
