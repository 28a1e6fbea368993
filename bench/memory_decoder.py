"""Memory Decoder (Intern-S2 walkthrough Ch. 2): does the plug-in specialise without regressing?

Measured in one run on held-out documents of both procedural languages (a document seed no phase
trained on): perplexity of the frozen backbone alone, of the memory decoder alone, and of the fused
model p = (1 - lambda_t) p_base + lambda_t p_mem with the trained router (Eq. 3), plus the router's
mean lambda per corpus. The claims checked and printed: the fused model lowers held-out *domain*
perplexity against the backbone, and keeps *general* perplexity within 2% of the backbone's.

    megatron-s2 launch recipes/memdec_tiny.yaml --local           # ~30 minutes on 2 shared CPU cores
    python bench/memory_decoder.py runs/memdec_tiny/backbone runs/memdec_tiny/router
    python bench/memory_decoder.py --smoke   # trains the three phases 3 steps each in a temp dir, no claims
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GENERAL_TOLERANCE = 0.02


def _train_smoke(work: Path) -> tuple[Path, Path]:
    """The three recipes of recipes/memdec_tiny.yaml, 3 steps each, tiny corpora."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    short = ["training.train_steps=3", "training.global_batch_size=4", "training.micro_batch_size=2",
             "logging.log_interval=1", "data.num_documents=30"]
    backbone, memory, router = work / "backbone", work / "memory", work / "router"
    for recipe, run, extra in (
            ("backbone_general.yaml", backbone, []),
            ("memory_pretrain.yaml", memory, [f"phase.memdec_backbone={backbone}"]),
            ("router.yaml", router, [f"phase.memdec_backbone={backbone}", f"checkpoint.load={memory / 'checkpoints'}",
                                     "phase.memdec_general_data.num_documents=30"])):
        cmd = [sys.executable, "-m", "megatron_s2.cli", "train", str(REPO / "recipes" / "memdec" / recipe),
               "--run-dir", str(run), *short, *extra]
        done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"smoke training of {recipe} failed:\n{done.stderr[-3000:]}")
    return backbone, router


def _perplexities(backbone: Path, plugin: Path, documents: int, seed: int, seq_length: int, language_seed: int) -> dict:
    from megatron_s2.data.procedural_text import build_procedural_text_documents
    from megatron_s2.posttrain.memdec.fusion import held_out_nll, load_fused

    fused, tokenizer = load_fused(backbone, plugin)
    out = {}
    for corpus in ("domain", "general"):
        store = build_procedural_text_documents(corpus, documents, seed, tokenizer, language_seed)
        for skip, key in ((False, corpus), (True, f"{corpus}*")):
            sums = held_out_nll(fused, [store], seq_length=seq_length, pad_id=tokenizer.pad_id, skip_document_start=skip)
            out[key] = {name: (math.exp(total / count) if name != "lambda" else total / count)
                        for name, (total, count) in sums.items()}
            out[key]["tokens"] = sums["fused"][1]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("backbone", nargs="?", help="the frozen backbone's run / checkpoint directory")
    parser.add_argument("plugin", nargs="?", help="the memdec_router run (memory decoder + router)")
    parser.add_argument("--documents", type=int, default=400, help="held-out documents per corpus")
    parser.add_argument("--seed", type=int, default=7, help="document seed of the held-out split (training used 1, 2)")
    parser.add_argument("--seq-length", type=int, default=64, help="window of context (the recipes train at 64)")
    parser.add_argument("--language-seed", type=int, default=0, help="data.language_seed of the runs")
    parser.add_argument("--smoke", action="store_true", help="train 3 steps per phase in a temp dir; print, no claims")
    args = parser.parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            backbone, plugin = _train_smoke(Path(tmp))
            return _report(_perplexities(backbone, plugin, 20, args.seed, args.seq_length, args.language_seed), claims=False)
    if not (args.backbone and args.plugin):
        parser.error("give the backbone and plug-in run directories (or --smoke)")
    if args.documents < 1:
        parser.error(f"--documents must be >= 1, got {args.documents}")
    try:
        figures = _perplexities(Path(args.backbone), Path(args.plugin), args.documents, args.seed, args.seq_length,
                                args.language_seed)
    except Exception as exc:  # a missing or mismatched run: one line, not a traceback
        from megatron_s2.config.schema import ConfigError

        if isinstance(exc, ConfigError):
            print(f"memory_decoder.py: {exc}", file=sys.stderr)
            return 2
        raise
    return _report(figures, claims=True)


def _report(figures: dict, claims: bool) -> int:
    print("held-out perplexity (lower is better)")
    print(f"{'corpus':<9}{'tokens':>8}{'backbone':>11}{'memory':>11}{'fused':>11}{'fused/backbone':>16}{'mean lambda':>13}")
    for corpus, f in figures.items():
        print(f"{corpus:<9}{f['tokens']:>8}{f['backbone']:>11.3f}{f['memory']:>11.3f}{f['fused']:>11.3f}"
              f"{f['fused'] / f['backbone']:>16.4f}{f['lambda']:>13.3f}")
    print("* without each document's first token (predicted from bos alone: no context tells the router the corpus)")
    if not claims:
        return 0
    domain, general = figures["domain"], figures["general"]
    lower = domain["fused"] < domain["backbone"]
    within = abs(general["fused"] / general["backbone"] - 1.0) <= GENERAL_TOLERANCE
    print(f"claim: fused lowers domain perplexity vs the backbone: {'yes' if lower else 'NO'} "
          f"({domain['backbone']:.3f} -> {domain['fused']:.3f})")
    print(f"claim: general perplexity within {GENERAL_TOLERANCE:.0%} of the backbone's: {'yes' if within else 'NO'} "
          f"({general['backbone']:.3f} -> {general['fused']:.3f}, {general['fused'] / general['backbone'] - 1:+.2%})")
    return 0 if lower and within else 1


if __name__ == "__main__":
    sys.exit(main())
