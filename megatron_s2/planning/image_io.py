"""When image loading hides behind compute: the report's I/O criterion (report §3.1.1, "Balanced
image sharding").

With images sharded across the CP ranks and each read once, loading ``N`` tokens takes
``N * rho / B_IO`` and computing them ``N * C / B_GPU``, so loading stays hidden whenever ::

    rho < (B_IO / B_GPU) * C

``N`` cancels: only per-token quantities matter, independent of sequence length and cluster size.

* ``rho``: raw image bytes per visual token, set by the vision configuration: decoded RGB
  (3 bytes a pixel, uncompressed — an upper bound on what storage serves; JPEG/PNG files are
  typically several times smaller) of the largest image the resize planning admits (the
  ``vision_max_n_token`` cap), divided by its span's tokens; the ``p x p`` patches and the
  ``r x r`` pixel-unshuffle put ``(p r)^2`` pixels behind each visual token. Family figure
  ``image_bytes_per_token`` of ``megatron-s2 account``.
* ``C``: training FLOPs per token of the LLM (forward + backward, attention averaged over a
  ``seq_length`` sequence: the family's ``train_flops_per_token``, what the trainer's TFLOP/s
  uses); the vision encoder's own work is left out, so the bound is conservative.
* ``B_IO``: file-system read bandwidth per GPU, bytes/s; ``B_GPU``: achieved FLOP/s per GPU
  (``megatron-s2 account --io-gbps / --gpu-tflops``; defaults :data:`DEFAULT_IO_GBPS`,
  :data:`DEFAULT_GPU_TFLOPS`).

Small models (little compute per token) come out I/O-bound, production-scale ones compute-bound,
as the report says.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_IO_GBPS", "DEFAULT_GPU_TFLOPS", "DEFAULT_SEQ_LENGTH", "ImageIOCriterion", "image_io_criterion"]

DEFAULT_IO_GBPS = 1.0
"""File-system read bandwidth per GPU, GB/s: a parallel file system serving a few TB/s to a few
thousand GPUs."""
DEFAULT_GPU_TFLOPS = 400.0
"""Achieved training throughput per GPU, TFLOP/s: ~40% of an H800/H100's 989 dense BF16 TFLOP/s."""
DEFAULT_SEQ_LENGTH = 4096
"""Sequence length over which ``C`` averages the attention FLOPs."""


@dataclass(frozen=True)
class ImageIOCriterion:
    rho: float
    """Raw image bytes per visual token."""
    flops_per_token: float
    """C: training FLOPs per token."""
    io_bytes_per_s: float
    gpu_flops_per_s: float

    @property
    def bound(self) -> float:
        """(B_IO / B_GPU) * C: the most bytes per token that loading can hide behind compute."""
        return self.io_bytes_per_s / self.gpu_flops_per_s * self.flops_per_token

    @property
    def compute_bound(self) -> bool:
        return self.rho < self.bound

    def line(self) -> str:
        verdict = "compute-bound: loading hides behind compute" if self.compute_bound else \
            "I/O-bound: loading images outlasts compute"
        return (f"image I/O criterion (§3.1.1)     rho {self.rho:,.0f} B/token "
                f"{'<' if self.compute_bound else '>='} (B_IO/B_GPU)*C = {self.bound:,.1f} B/token  "
                f"[B_IO {self.io_bytes_per_s / 1e9:g} GB/s, B_GPU {self.gpu_flops_per_s / 1e12:g} TFLOP/s, "
                f"C {self.flops_per_token:.4g} FLOP/token]: {verdict}")

    def figures(self) -> dict:
        return {"rho_bytes_per_token": self.rho, "flops_per_token": self.flops_per_token,
                "io_bytes_per_s": self.io_bytes_per_s, "gpu_flops_per_s": self.gpu_flops_per_s,
                "bound_bytes_per_token": self.bound, "compute_bound": self.compute_bound}


def image_io_criterion(rho: float, flops_per_token: float, *, io_gbps: float = DEFAULT_IO_GBPS,
                       gpu_tflops: float = DEFAULT_GPU_TFLOPS) -> ImageIOCriterion:
    """The criterion for a model's ``rho`` and ``C`` under the stated bandwidths."""
    if io_gbps <= 0 or gpu_tflops <= 0:
        raise ValueError(f"image I/O criterion: bandwidths must be > 0 (io {io_gbps} GB/s, gpu {gpu_tflops} TFLOP/s)")
    return ImageIOCriterion(rho, flops_per_token, io_gbps * 1e9, gpu_tflops * 1e12)
