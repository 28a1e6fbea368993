"""Working set of the Memory Decoder's objectives per position and vocabulary entry (walkthrough
Ch. 2, Eq. 2 and Eq. 3-4; megatron_s2/posttrain/memdec/objectives.py) — the figure `plan memory`
multiplies by micro_batch_size x seq_length x vocab_size (megatron_s2/planning/posttrain.py,
MEMDEC_OBJECTIVE_BYTES).

Each objective runs on every tensor-parallel rank of the last stage over the *whole* vocabulary:
the memory's gathered logits, the kNN distribution (built in float64, kept in float32) and Eq. 2
with its backward (``memdec``); the backbone's and the memory's log-probabilities, the router
features, the fused log-mix of Eq. 3 and Eq. 4's backward (``router``). Measured here as the peak
resident-set growth of a fresh process over the inputs that are not [s, V] (CPU, float32; a GPU's
caching allocator holds the same tensors), divided by s x V:

    python bench/memdec_objective_bytes.py            # measured on this machine: memdec 24.1, router 44.3
    python bench/memdec_objective_bytes.py --smoke    # 16 positions (the figure is then dominated by noise)
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys

V, K = 248_320, 32


def _measure(which: str, S: int) -> float:
    import torch

    from megatron_s2.models.memory_decoder import (interpolated_log_probs, knn_log_probs, memory_decoder_token_loss,
                                                   router_token_loss)
    from megatron_s2.models.memory_decoder.router import MemoryRouter

    torch.manual_seed(0)
    labels = torch.randint(0, V, (1, S))
    distances, values = torch.rand(1, S, K), torch.randint(0, V, (1, S, K))
    router = MemoryRouter(64, 32, 0.1, 256)
    h_base, h_mem = torch.randn(1, S, 64), torch.randn(1, S, 32)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if which == "memdec":
        logits = torch.randn(1, S, V, requires_grad=True)  # the memory's logits, gathered over tp
        knn = knn_log_probs(distances.double(), values, V, 1.0).float()
        per_token, _, _ = memory_decoder_token_loss(logits, knn, labels, beta=0.5)
        per_token.sum().backward()
    else:
        with torch.no_grad():  # both models frozen: their log-probabilities carry no graph
            logp_base = torch.log_softmax(torch.randn(1, S, V), -1)
            logp_mem = torch.log_softmax(torch.randn(1, S, V), -1)
        lam = router(h_base, h_mem, logp_base, logp_mem)
        fused = interpolated_log_probs(logp_base, logp_mem, lam)
        per_token, _ = router_token_loss(fused, labels, lam, torch.ones(1, S, dtype=torch.bool), 1.0)
        per_token.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return (peak - base) * 1024 / (S * V)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="16 positions instead of 256")
    parser.add_argument("--measure", choices=("memdec", "router"), help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--positions", type=int, default=256)
    args = parser.parse_args()
    positions = 16 if args.smoke else args.positions
    if args.measure:
        print(f"{_measure(args.measure, positions):.1f}")
        return
    for which in ("memdec", "router"):  # a fresh process each: ru_maxrss is a per-process peak
        out = subprocess.run([sys.executable, __file__, "--measure", which, "--positions", str(positions)],
                             capture_output=True, text=True, check=True)
        print(f"{which}: {out.stdout.strip()} bytes per position x vocabulary entry (s={positions}, V={V})")


if __name__ == "__main__":
    main()
