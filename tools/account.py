"""`megatron-s2 account <model.yaml | recipe.yaml> [--json]`: size a model before booking a cluster.

Prints backbone and Engram parameters, activated parameters per token in decode and in
prefill (CED: encoder + decoder KV projections only, report §2.2), global KV-cache bytes per
token held in HBM and persistent KV bytes per token by format (§2.4.4, §3.2.1), SWA state
bytes per request, and decode FLOPs per token at 4K and 1M context. Everything is computed
from the same config objects the model is built from (megatron_s2.models.v41.accounting).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from megatron_s2.config.model import ModelConfig
from megatron_s2.config.recipe import load_recipe
from megatron_s2.config.schema import ConfigError, from_mapping

__all__ = ["register", "run", "load_model_config"]


def load_model_config(path: str) -> ModelConfig:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"'{path}' does not exist; pass a model file (recipes/models/*.yaml) or a recipe")
    data = yaml.safe_load(file.read_text()) or {}
    if isinstance(data, dict) and "layer_groups" in data:
        return from_mapping(ModelConfig, data, "model")
    return load_recipe(file).model


def _human(n: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def format_report(a: dict) -> str:
    kv = a["breakdown"]["kv"]
    p = a["breakdown"]["params"]
    lines = [
        f"model: {a['model']}",
        f"backbone parameters           {a['backbone_params']:>20,}  ({_human(a['backbone_params'])})",
        f"  embedding / head            {p['embedding']:>20,} / {p['head']:,}",
        f"  attention (CSA2 + SWA)      {p['attention']:>20,}",
        f"  MoE routed experts          {p['moe_routed']:>20,}",
        f"  MoE router + shared expert  {p['moe_other']:>20,}",
        f"  mHC + norms                 {p['mhc'] + p['norms']:>20,}",
        f"Engram parameters             {a['engram_params']:>20,}  ({_human(a['engram_params'])})",
        f"activated params / token, decode   {a['activated_params_decode']:>14,}  ({_human(a['activated_params_decode'])})",
        f"activated params / token, prefill  {a['activated_params_prefill']:>14,}  ({_human(a['activated_params_prefill'])})",
        f"global KV bytes / token (HBM)      {a['global_kv_bytes_per_token']:>14,.1f}",
        f"  main KV   [{kv['main_kv_format']}]  {kv['main_kv_bytes_per_token']:>10,.1f}",
        f"  index K   [{kv['index_k_format']}]  {kv['index_k_bytes_per_token']:>8,.1f}",
        f"persistent KV bytes / token        {a['persistent_kv_bytes_per_token']:>14,.1f}  (SWA KV not persisted)",
        f"SWA state bytes / request [{kv['swa_kv_format']}]  {a['swa_state_bytes_per_request']:,.0f}",
        f"decode FLOPs / token @ 4K          {a['decode_flops_4k']:>14.4g}",
        f"decode FLOPs / token @ 1M          {a['decode_flops_1m']:>14.4g}",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from megatron_s2.models.v41.accounting import account

    result = account(load_model_config(args.config))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_report(result))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("account", help="parameter / KV-cache / FLOP accounting of a model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="model file (recipes/models/*.yaml) or recipe")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
