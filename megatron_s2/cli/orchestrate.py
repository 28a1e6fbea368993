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
import sys

from megatron_s2.config.recipe import load_recipe
from megatron_s2.config.schema import ConfigError

__all__ = ["register", "run", "server_urls"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("orchestrate", help="the orchestrator of disaggregated RL (rl.mode: disaggregated)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="the rl phase's recipe YAML (or its run's config.yaml)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides (the trainer's, too)")
    p.add_argument("--servers", required=True, help="comma-separated base URLs of the inference servers")
    p.add_argument("--run-dir", default=None, help="run directory (default: training.run_dir of the recipe)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    servers = server_urls(args.servers)
    recipe = load_recipe(args.recipe, list(args.overrides))
    if args.run_dir:
        recipe = recipe.replace(training=dataclasses.replace(recipe.training, run_dir=args.run_dir))
    if recipe.phase.kind != "rl" or recipe.rl.mode != "disaggregated":
        raise ConfigError(f"rl.mode: {args.recipe} is not a disaggregated RL phase (phase.kind: rl, rl.mode: "
                          "disaggregated); the co-located mode needs no orchestrator process")
    from megatron_s2.posttrain.disaggregated.orchestrator_role import run_orchestrator
    from megatron_s2.posttrain.disaggregated.served_backend import ServerUnavailable

    try:
        return run_orchestrator(recipe, servers, log=lambda m: print(m, flush=True))
    except ServerUnavailable as exc:  # the servers, not the recipe: one line, exit 1 (the trainer is told too)
        print(f"megatron-s2 orchestrate: {exc}", file=sys.stderr)
        return ServerUnavailable.exit_code


def server_urls(text: str) -> list[str]:
    """The ``--servers`` list, each an http(s) base URL with a host, none twice. Checked here
    because a malformed URL is otherwise only a server that never answers (``server_wait_s``
    later), and a repeated one would double that server's share of the calls."""
    from urllib.parse import urlsplit

    urls, seen = [], {}
    for raw in (u.strip() for u in text.split(",")):
        if not raw:
            continue
        try:
            parts = urlsplit(raw)
            port = parts.port  # ValueError when out of range or not a number
        except ValueError:
            parts, port = None, None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"--servers: '{raw}' is not an http(s) base URL of an inference server; write it as "
                              "http://HOST:PORT, e.g. http://127.0.0.1:8100")
        key = (parts.scheme, parts.hostname.lower(), port or (443 if parts.scheme == "https" else 80),
               parts.path.rstrip("/"))
        if key in seen:
            raise ConfigError(f"--servers: '{raw}' names the same server as '{seen[key]}' (listed twice); "
                              "give each inference server once")
        seen[key] = raw
        urls.append(raw)
    if not urls:
        raise ConfigError("--servers: give at least one inference server URL, e.g. http://127.0.0.1:8100")
    return urls
