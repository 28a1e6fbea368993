"""``megatron-s2 orchestrate <recipe> [overrides] --servers URL[,URL...] [--run-dir DIR]``.

The orchestrator role of disaggregated RL (``rl.mode: disaggregated``,
:mod:`megatron_s2.posttrain.disaggregated`): plays the recipe's environments against the
inference servers over HTTP and writes one batch file per training step into
``<run>/disaggregated/batches`` for the trainer (``megatron-s2 train`` on the same recipe). Started
by ``megatron-s2 launch`` beside the servers and the trainer; run it by hand to place the roles
yourself. A restarted orchestrator continues after the last batch it wrote.
"""

from __future__ import annotations

import argparse
import dataclasses

from megatron_s2.config.recipe import load_recipe
from megatron_s2.config.schema import ConfigError

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("orchestrate", help="the orchestrator of disaggregated RL (rl.mode: disaggregated)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="the rl phase's recipe YAML (or its run's config.yaml)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides (the trainer's, too)")
    p.add_argument("--servers", required=True, help="comma-separated base URLs of the inference servers")
    p.add_argument("--run-dir", default=None, help="run directory (default: training.run_dir of the recipe)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, list(args.overrides))
    if args.run_dir:
        recipe = recipe.replace(training=dataclasses.replace(recipe.training, run_dir=args.run_dir))
    if recipe.phase.kind != "rl" or recipe.rl.mode != "disaggregated":
        raise ConfigError(f"rl.mode: {args.recipe} is not a disaggregated RL phase (phase.kind: rl, rl.mode: "
                          "disaggregated); the co-located mode needs no orchestrator process")
    servers = [u.strip() for u in args.servers.split(",") if u.strip()]
    if not servers:
        raise ConfigError("--servers: give at least one inference server URL, e.g. http://127.0.0.1:8100")
    from megatron_s2.posttrain.disaggregated.orchestrator_role import run_orchestrator

    return run_orchestrator(recipe, servers, log=lambda m: print(m, flush=True))
