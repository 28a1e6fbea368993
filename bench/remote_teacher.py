"""Sampled-token OPD teacher log-probs (walkthrough Ch. 8, Eq. 33) of one micro-batch: the teacher
in process (one batched forward) against the same checkpoint behind ``megatron-s2 serve``'s app
on this machine (one ``/v1/completions`` request with ``prompt_logprobs: 0`` per row, several in
flight), side by side in one run; also the largest |difference| of the log-probs.

    python bench/remote_teacher.py runs/sft_addition            # any run / checkpoint directory
    python bench/remote_teacher.py runs/sft_addition --rows 32 --length 128 --concurrency 1 4 8
    python bench/remote_teacher.py                              # a 1-step tiny SFT checkpoint, made here
    python bench/remote_teacher.py --smoke                      # seconds: 4 rows x 16 tokens

The server scores rows one forward at a time on its engine's driver thread, so on a CPU the
remote path costs about the sum of per-row forwards plus HTTP; its point is a teacher that does
not fit (or is not resident) next to the student.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_s2.inference.weights import load_model  # noqa: E402
from megatron_s2.config.engine import EngineConfig  # noqa: E402
from megatron_s2.posttrain.frozen import TeacherPool, load_frozen_model  # noqa: E402
from megatron_s2.posttrain.opd.remote_teacher import RemoteTeacher  # noqa: E402
from megatron_s2.serve import ServeConfig, ServerThread, build_state  # noqa: E402


def timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    return (time.perf_counter() - t0) / repeats, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", nargs="?", help="run / checkpoint directory (default: a 1-step tiny SFT made "
                                                   "in a temporary directory; timings do not depend on the weights)")
    ap.add_argument("--smoke", action="store_true", help="4 rows x 16 tokens, 2 in flight, once")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.length, args.concurrency, args.repeats = 4, 16, [2], 1
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint is None:
            from megatron_s2.cli import main as cli

            args.checkpoint = str(Path(tmp) / "teacher")
            recipe = Path(__file__).resolve().parents[1] / "recipes" / "phases" / "sft_addition.yaml"
            if cli(["train", str(recipe), "training.train_steps=1", "schedule.warmup_steps=0",
                    "schedule.decay_start_step=1", "schedule.decay_end_step=2", "checkpoint.save_interval=1",
                    "logging.progress_bar=false", "logging.tensorboard=false", "--run-dir", args.checkpoint]) != 0:
                raise SystemExit("bench/remote_teacher.py: the 1-step SFT checkpoint failed")
        run(args)


def run(args) -> None:
    torch.manual_seed(0)
    model, tokenizer, description = load_model(args.checkpoint, "cpu")
    vocab = model.config.vocab_size
    teacher = load_frozen_model(args.checkpoint, model.groups, vocab_size=vocab, tokenizer=tokenizer, what="teacher")
    ids = torch.randint(1, tokenizer.vocab_size, (args.rows, args.length + 1))
    tokens, labels = ids[:, :-1], ids[:, 1:]
    mask = torch.ones_like(tokens, dtype=torch.bool)
    local = TeacherPool({"t": teacher}, {"d": "t"}, {"t": 1.0})
    domains = ["d"] * args.rows
    t_local, ref = timed(lambda: local.token_logprobs(tokens, labels, domains, model.groups.tp, mask), args.repeats)
    print(f"{args.rows} rows x {args.length} tokens, {description}")
    print(f"{'teacher':<28} {'ms / micro-batch':>16} {'x in-process':>13} {'max |diff|':>11}")
    print(f"{'in process':<28} {t_local * 1e3:>16.1f} {1.0:>13.2f} {0.0:>11.1e}")
    state = build_state(model, tokenizer, description, ServeConfig(),
                        EngineConfig(max_num_seqs=8, max_model_len=args.length + 8), model_name="teacher")
    with ServerThread(state) as server:
        for c in args.concurrency:
            remote = RemoteTeacher("t", f"{server.url}/v1", max_concurrent_requests=c).connect(vocab)
            pool = TeacherPool({}, {"d": "r"}, {"r": 1.0}, {"r": remote})
            t, out = timed(lambda: pool.token_logprobs(tokens, labels, domains, model.groups.tp, mask), args.repeats)
            diff = float((out - ref).abs().max())
            print(f"{f'endpoint, {c} in flight':<28} {t * 1e3:>16.1f} {t / t_local:>13.2f} {diff:>11.1e}")
            remote.close()


if __name__ == "__main__":
    main()
