"""Per-step metrics: a log line, ``metrics.jsonl``, TensorBoard events and a progress bar.

Only rank 0 writes. Model TFLOP/s come from the accounting module's FLOP count, which
counts CSA2 attention as sparse (window + top-k entries and the indexer's scored entries)
rather than dense; MFU is reported on GPUs against a table of dense BF16 peaks.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

__all__ = ["MetricsLogger", "device_peak_tflops"]

# Dense BF16 tensor-core peaks (TFLOP/s) by device-name substring.
_PEAKS = (("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("A100", 312.0), ("A800", 312.0),
          ("L40S", 362.0), ("B200", 2250.0), ("GB200", 2500.0))


def device_peak_tflops(override: float = 0.0) -> float | None:
    if override > 0:
        return override
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name()
            for key, peak in _PEAKS:
                if key in name:
                    return peak
    except Exception:  # pragma: no cover - best effort lookup
        return None
    return None


def truncate_jsonl(path: Path, step: int) -> None:
    """Keep the records of ``path`` (one JSON object per line, with an integer ``step``) up to
    ``step``: later ones were written by an attempt that died before its next checkpoint and
    are re-run; a line torn by kill -9 mid-write is dropped too. Atomic (temporary + rename)."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int) or record["step"] <= step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class MetricsLogger:
    def __init__(self, run_dir: Path, *, enabled: bool, total_steps: int, log_interval: int,
                 tensorboard: bool, progress_bar: bool, flops_per_token: float, world_size: int,
                 peak_tflops: float | None):
        self.enabled = enabled
        self.total_steps, self.log_interval = total_steps, log_interval
        self.flops_per_token, self.world_size, self.peak = flops_per_token, world_size, peak_tflops
        self.history: list[dict] = []
        self._file = self._tb = self._bar = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)
        self._t0 = time.time()

    def set_start(self, step: int) -> None:
        """The run (re)starts after ``step``: records of later steps, written before a crash that
        lost their checkpoint (kill -9, node failure), are re-run now and are dropped from
        ``metrics.jsonl`` (and so is a line torn by the crash) and hidden in TensorBoard (a purge
        marker at ``step + 1``); each step then appears once."""
        if self._file is not None:
            path = Path(self._file.name)
            self._file.close()
            truncate_jsonl(path, step)
            self._file = open(path, "a", buffering=1)
        if self._tb is not None and step > 0:
            # TensorBoard's own mechanism: a new event file that starts with a restart marker at
            # step + 1, so readers hide the events the dead attempt wrote for the re-run steps
            from torch.utils.tensorboard import SummaryWriter

            log_dir = self._tb.log_dir
            self._tb.close()
            self._tb = SummaryWriter(log_dir=log_dir, purge_step=step + 1)
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def log(self, step: int, loss: float, lr: float, grad_norm: float, tokens: int, step_time: float,
            extra: dict[str, float]) -> dict:
        tokens_per_s = tokens / max(step_time, 1e-9)
        tflops = tokens_per_s * self.flops_per_token / 1e12
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                  "tokens_per_s": tokens_per_s, "step_time_s": step_time, "model_tflops": tflops}
        if self.peak:
            record["mfu"] = tflops / (self.peak * self.world_size)
        record.update(extra)
        self.history.append(record)
        if not self.enabled:
            return record
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"train/{key}", value, step)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
        elif step % self.log_interval == 0 or step == self.total_steps:
            aux = " ".join(f"{k}={v:.4g}" for k, v in extra.items())
            print(f"step {step:>6}/{self.total_steps} | loss {loss:.4f} | lr {lr:.3e} | grad_norm {grad_norm:.3f} "
                  f"| {tokens_per_s:,.0f} tok/s | {tflops:.3f} TFLOP/s | {step_time * 1e3:.0f} ms"
                  + (f" | {aux}" if aux else ""), flush=True)
        return record

    def summary(self) -> str:
        if not self.history:
            return "no steps were run"
        first, last = self.history[0], self.history[-1]
        n = len(self.history)
        mean_time = sum(r["step_time_s"] for r in self.history) / n
        mean_tps = sum(r["tokens_per_s"] for r in self.history) / n
        return (f"trained steps {first['step']}..{last['step']}: loss {first['loss']:.4f} -> {last['loss']:.4f}, "
                f"mean step {mean_time * 1e3:.0f} ms, {mean_tps:,.0f} tokens/s, "
                f"wall {time.time() - self._t0:.1f} s" if self.enabled else "")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
