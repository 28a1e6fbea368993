"""Built-in verification of conversions: tensors and logits after a round trip.

A conversion that silently produces garbage is the failure this guards against, so both CLI
directions verify by default:

* **export**: the written directory is imported back and every tensor compared with the
  source (bitwise for a lossless export); the logits of the *trained* model — the checkpoint's
  weights with the Engram compressed token map of the tokenizer it was trained with — on text
  tokens (a fixed text encoded by that tokenizer, :func:`text_inputs`) are stored next to the
  weights (``megatron_s2_verification.safetensors``) and compared with the logits of the model
  rebuilt from the exported directory alone (weights, ``config.json`` *and* the tokenizer files
  written beside them) — max |diff| and KL(source || converted) per token. An export that lost
  the tokenizer, or its map, changes most Engram hash ids and fails here.
* **import**: when the directory carries that file (it was exported by us), the imported
  model's logits on the stored inputs are compared with the stored logits, again with the
  directory's tokenizer. A checkpoint without it (e.g. the official release) gets the
  tensor-level checks of the importer (every name, shape and source tensor accounted for)
  and the report says that no reference logits were available.

Running the model needs its full weights in memory; above ``max_params`` the logits check is
skipped and the report says so (the tensor comparison still runs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save as save_bytes

from megatron_s2.checkpoint.hf.safetensors_io import SIDECAR_PREFIX, check_safetensors_file, open_safetensors
from megatron_s2.models.family.skeleton import skeleton_state
from megatron_s2.config.model_schema import ModelSchema
from megatron_s2.config.schema import to_mapping

__all__ = ["VerificationFailed", "VERIFICATION_FILE", "DEFAULT_VERIFY_MAX_PARAMS", "VERIFICATION_TEXT", "LogitsCheck", "VerificationReport",
           "fixed_inputs", "text_inputs", "model_logits", "logits_divergence", "reference_logits",
           "check_reference_logits", "compare_states"]

VERIFICATION_FILE = f"{SIDECAR_PREFIX}verification.safetensors"
DEFAULT_VERIFY_MAX_PARAMS = 300_000_000
LOSSLESS_TOL = (1e-4, 1e-7)   # (max |logit diff|, KL) for exports that keep every dtype
LOSSY_TOL = (float("inf"), 1e-2)


class VerificationFailed(ValueError):
    """A conversion whose result does not reproduce its source (exit 1, one line, nothing committed)."""

    exit_code = 1


@dataclass
class LogitsCheck:
    max_abs_diff: float
    kl: float
    tokens: int
    atol: float
    kl_tol: float
    differing_fields: list[str] = field(default_factory=list)
    """Model-config fields in which the exporter's model (stored with the logits) differs from the
    one being checked: the likely cause of a failure."""

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.atol and self.kl <= self.kl_tol

    def line(self) -> str:
        verdict = "ok" if self.passed else "FAILED"
        return (f"logits on {self.tokens} fixed tokens: max |diff| {self.max_abs_diff:.3e}, "
                f"KL {self.kl:.3e} (limits {self.atol:g}, {self.kl_tol:g}): {verdict}")


@dataclass
class VerificationReport:
    tensors_checked: int = 0
    tensor_mismatches: list[str] = field(default_factory=list)
    max_tensor_diff: float = 0.0
    logits: LogitsCheck | None = None
    logits_skipped: str | None = None

    @property
    def passed(self) -> bool:
        return not self.tensor_mismatches and (self.logits is None or self.logits.passed)

    def lines(self) -> list[str]:
        out = [f"tensors: {self.tensors_checked} compared, {len(self.tensor_mismatches)} differ "
               f"(max |diff| {self.max_tensor_diff:.3e})"]
        out += [f"  {m}" for m in self.tensor_mismatches[:8]]
        out.append(self.logits.line() if self.logits else f"logits: not checked ({self.logits_skipped})")
        return out


def num_params(cfg: ModelSchema) -> int:
    return sum(torch.Size(i.full_shape).numel() for i in skeleton_state(cfg).values())


VERIFICATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG!\n"
    "12+30=42; 7*6=42; sort: dcba -> abcd; copy:Hello World; reverse:olleH; balanced:(()) yes.\n"
    "\tTabs, spaces  and\nnew lines; Café, naïve, façade — accents and dashes.\n"
)
"""Text whose tokens drive the logits check: mixed case, digits, punctuation and whitespace
kinds, so that the Engram compressed token map (case and whitespace folding) matters."""


def fixed_inputs(cfg: ModelSchema, batch: int = 2, seq: int = 32, seed: int = 20240731) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)


def text_inputs(tokenizer, cfg: ModelSchema, batch: int = 2, seq: int = 32) -> torch.Tensor:
    """``[batch, seq]`` ids of :data:`VERIFICATION_TEXT` encoded by ``tokenizer`` (repeated to
    length, one row per offset), each row starting with bos."""
    ids = tokenizer.encode(VERIFICATION_TEXT)
    stream = [tokenizer.bos_id] + ids * (1 + batch * seq // max(1, len(ids)))
    rows = [stream[r * (seq // 2): r * (seq // 2) + seq] for r in range(batch)]
    out = torch.tensor(rows, dtype=torch.long)
    if int(out.max()) >= cfg.vocab_size:
        raise ValueError(f"the tokenizer produces id {int(out.max())}, beyond the model's vocab_size {cfg.vocab_size}")
    return out


@torch.no_grad()
def model_logits(cfg: ModelSchema, state: dict[str, torch.Tensor], input_ids: torch.Tensor,
                 token_map: list[int] | None = None) -> torch.Tensor:
    """Float32 logits of the single-rank model holding ``state``, with the tokenizer's compressed
    token map ``token_map`` where the family uses one (Engram n-grams; None = identity)."""
    from megatron_s2.models.family import family_of

    model = family_of(cfg).build_model(cfg, portable=True)
    model.load_state_dict(state, strict=True)
    model.set_token_map(token_map)
    model.eval()
    return model(input_ids).float()


def logits_divergence(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(max |ref - got|, mean over tokens of KL(softmax ref || softmax got))."""
    max_abs = float((ref - got).abs().max())
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    kl = float((lp.exp() * (lp - lq)).sum(-1).mean())
    return max_abs, max(kl, 0.0)


def reference_logits(cfg: ModelSchema, state: dict[str, torch.Tensor], *, lossless: bool, tokenizer=None,
                     max_params: int = DEFAULT_VERIFY_MAX_PARAMS) -> tuple[bytes | None, str | None]:
    """(verification file contents, None) or (None, reason the logits cannot be computed).

    The logits are those of the trained model: ``state`` with ``tokenizer``'s compressed token
    map, on text tokens of that tokenizer (random ids without one). ``lossless``: the weights
    are written without a dtype cast, so the converted model must reproduce these logits to
    float32 rounding; otherwise only the KL bound applies."""
    n = num_params(cfg)
    if n > max_params:
        return None, f"{n:,} parameters exceed the verification limit of {max_params:,}"
    ids = fixed_inputs(cfg) if tokenizer is None else text_inputs(tokenizer, cfg)
    token_map = None if tokenizer is None else tokenizer.compressed_token_map(cfg.vocab_size)
    logits = model_logits(cfg, state, ids, token_map)
    meta = {"model": cfg.name, "lossless": "true" if lossless else "false",
            "model_config": json.dumps(to_mapping(cfg), sort_keys=True)}  # the exporter's model, for diagnosis
    return save_bytes({"input_ids": ids, "logits": logits}, metadata=meta), None


def check_reference_logits(cfg: ModelSchema, state: dict[str, torch.Tensor], hf_dir: str | Path, *,
                           token_map: list[int] | None = None,
                           max_params: int = DEFAULT_VERIFY_MAX_PARAMS) -> tuple[LogitsCheck | None, str | None]:
    """Compare the logits of ``state`` (Engram hashing through ``token_map``) with those
    stored in ``hf_dir`` (None + reason if impossible)."""
    path = Path(hf_dir) / VERIFICATION_FILE
    if not path.is_file():
        return None, f"no {VERIFICATION_FILE} in {hf_dir} (not exported by megatron_s2)"
    n = num_params(cfg)
    if n > max_params:
        return None, f"{n:,} parameters exceed the verification limit of {max_params:,}"
    check_safetensors_file(path)
    with open_safetensors(path) as f:
        meta = f.metadata() or {}
        stored = {k: f.get_tensor(k) for k in ("input_ids", "logits")}
    lossless = meta.get("lossless") == "true"
    got = model_logits(cfg, state, stored["input_ids"], token_map)
    max_abs, kl = logits_divergence(stored["logits"], got)
    atol, kl_tol = LOSSLESS_TOL if lossless else LOSSY_TOL
    return LogitsCheck(max_abs, kl, stored["input_ids"].numel(), atol, kl_tol,
                       _differing_fields(meta.get("model_config"), cfg)), None


def _differing_fields(exported: str | None, cfg: ModelSchema) -> list[str]:
    if not exported:
        return []
    try:
        theirs = json.loads(exported)
    except (ValueError, RecursionError):
        return []
    ours = to_mapping(cfg)
    ignore = {"name", "init_std"}  # neither changes the logits
    return sorted(k for k in set(ours) | set(theirs) if k not in ignore and ours.get(k) != theirs.get(k))


def compare_states(source: dict[str, torch.Tensor], converted: dict[str, torch.Tensor],
                   dtype: torch.dtype | None, report: VerificationReport) -> None:
    """Every tensor of ``converted`` equal to ``source`` (after the export's cast when lossy)."""
    for name, ref in source.items():
        report.tensors_checked += 1
        got = converted.get(name)
        if got is None or got.shape != ref.shape:
            report.tensor_mismatches.append(f"{name}: {'missing' if got is None else tuple(got.shape)}")
            continue
        expect = ref if dtype is None or not ref.is_floating_point() else ref.to(dtype).to(ref.dtype)
        if got.dtype != expect.dtype or not torch.equal(got, expect):
            if dtype is not None and got.is_floating_point() and got.dtype == expect.dtype:
                # a tensor the reference keeps in float32 was not cast: compare with the source
                if torch.equal(got, ref):
                    continue
            diff = float((got.double() - ref.double()).abs().max()) if got.is_floating_point() else float("nan")
            report.max_tensor_diff = max(report.max_tensor_diff, diff)
            report.tensor_mismatches.append(f"{name}: differs (max |diff| {diff:.3e})")
