"""Visual next-patch prediction: the model side (Intern-S2 walkthrough Ch. 3, Eq. 5–6).

Rendered pages become a visual sequence the language backbone continues, patch by patch:

* **Eq. (5)** ``z = E_v(I)``; ``u = RasterScan({z_i : m_i = 1})`` — a *frozen* visual encoder
  turns the page into per-patch latents, a foreground mask ``m`` "removes blank regions", and
  the survivors keep raster-scan order (left to right, top to bottom, as a person reads).
  :func:`patchify` lays the patches out row-major, so raster order is the grid order and
  :func:`raster_scan` only has to drop the blank ones and left-pack the rest.
* **Eq. (6)** ``u_hat_{t+1} = psi(Phi_theta(W_in u_{<=t})_t)`` — the latents are projected into
  the backbone's width by ``W_in``, run causally through the backbone ``Phi_theta``, and a
  lightweight head ``psi`` maps the hidden state at ``t`` to a prediction of latent ``t + 1``.

The design is family-neutral: the backbone is any family model that takes vectors in place of
token embeddings (``embed_vectors`` / ``final_hidden``, :func:`backbone_hidden`). Trained are the
backbone, ``W_in`` and ``psi``; "the visual encoder remains frozen" — it is a fixed measuring
instrument (:class:`PatchEncoder`: a linear patch embedding drawn once from the seed and never
updated, a stand-in for a pre-trained tower). The contrastive score of the predictions (Eq. 7–9)
is the training objective's: :mod:`megatron_s2.training.next_patch_objective`.

The foreground mask is decided on the page's pixels (a patch is ink when one of its pixels
differs from the paper colour by more than a threshold): with a per-patch encoder that is the
same as testing the latent against the blank patch's latent, and it does not depend on the
encoder's numerics.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megatron_s2.models.init import initialize_parameters, normal_init
from megatron_s2.parallel.linear import ReplicatedLinear

__all__ = ["patchify", "foreground_mask", "raster_scan", "PatchEncoder", "NextPatchPredictor", "backbone_hidden"]


def patchify(pages: torch.Tensor, patch: int) -> torch.Tensor:
    """Pages [B, C, H, W] -> patches [B, N, C * patch * patch] in raster order (row-major over
    the ``H / patch x W / patch`` grid; each patch flattened channel-major)."""
    b, c, h, w = pages.shape
    if h % patch or w % patch:
        raise ValueError(f"a {h}x{w} page does not tile into {patch}x{patch} patches")
    grid = pages.reshape(b, c, h // patch, patch, w // patch, patch)
    return grid.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


def foreground_mask(patches: torch.Tensor, *, paper: float = 1.0, threshold: float = 0.1) -> torch.Tensor:
    """[B, N] bool: patch i carries ink (m_i = 1, Eq. 5) — some pixel differs from the paper
    colour ``paper`` by more than ``threshold``. Blank paper is dropped: predicting "blank follows
    blank" has essentially zero loss and therefore zero gradient (walkthrough, Worked example 8)."""
    return (patches - paper).abs().amax(dim=-1) > threshold


def raster_scan(latents: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (5): the kept latents of each page in raster order, left-packed.

    ``latents`` [B, N, D] in grid order, ``mask`` [B, N] -> (``u`` [B, L, D], ``valid`` [B, L]) with
    ``L = max kept`` (at least 1); row b holds its ``mask[b].sum()`` kept latents first, zeros after."""
    kept = mask.sum(dim=1)
    length = max(int(kept.max()) if kept.numel() else 0, 1)
    # A stable sort on "is blank" moves the kept patches to the front without reordering them.
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :length]
    u = torch.gather(latents, 1, order.unsqueeze(-1).expand(-1, -1, latents.size(-1)))
    valid = torch.arange(length, device=mask.device) < kept.unsqueeze(1)
    return u * valid.unsqueeze(-1).to(u.dtype), valid


class PatchEncoder(nn.Module):
    """The frozen visual encoder E_v of Eq. (5): flattened pixel patch -> latent of ``dim``.

    A linear embedding of the patch's ink (``paper - pixels``) followed by a parameter-free RMS
    normalisation, drawn once from the seed and frozen (``requires_grad`` off, so the optimiser
    never holds it): a random projection that keeps distinct patches distinct. It reads the ink,
    not the raw pixels, because pale pixels all point the same way — raw patches of a page have
    cosine similarities near 1, which would leave the contrastive score (Eq. 7) nothing to tell
    apart. It is the instrument the sequence is measured with, not a model being trained
    (walkthrough: "The visual encoder remains frozen")."""

    def __init__(self, patch_dim: int, dim: int, paper: float = 1.0):
        super().__init__()
        self.paper = paper
        self.proj = ReplicatedLinear(patch_dim, dim)
        self.proj.weight.requires_grad_(False)

    @torch.no_grad()
    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        z = self.proj((self.paper - patches).to(self.proj.weight.dtype))
        return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6)


class NextPatchPredictor(nn.Module):
    """The visual next-patch pieces beside a backbone: the frozen encoder ``E_v``, the visual
    projection ``W_in`` (latent -> backbone width) and the prediction head ``psi`` (backbone
    width -> latent), Eq. (5)–(6)."""

    def __init__(self, *, patch: int, channels: int, latent_dim: int, hidden_size: int):
        super().__init__()
        self.patch = patch
        self.encoder = PatchEncoder(channels * patch * patch, latent_dim)
        self.w_in = ReplicatedLinear(latent_dim, hidden_size)
        self.head = ReplicatedLinear(hidden_size, latent_dim)
        for linear in (self.encoder.proj, self.w_in, self.head):  # variance-preserving: std 1/sqrt(fan_in)
            linear.weight.init_fn = normal_init(1.0 / math.sqrt(linear.in_features))

    def init_weights(self, seed: int) -> "NextPatchPredictor":
        """Layout-independent initialisation from (seed, parameter name)."""
        initialize_parameters(self, seed, std=1.0)  # every weight carries its own init_fn
        return self

    def scan(self, pages: torch.Tensor, *, paper: float, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. (5) on pages [B, C, H, W] in [0, 1]: (``u`` [B, L, Dv], ``valid`` [B, L])."""
        patches = patchify(pages, self.patch)
        return raster_scan(self.encoder(patches), foreground_mask(patches, paper=paper, threshold=threshold))

    def encode(self, patches: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Already-scanned pixel patches [B, L, C * p * p] (the data path's rows) -> ``u`` [B, L, Dv],
        zero where ``valid`` is off (the per-patch encoder commutes with the scan)."""
        z = self.encoder(patches)
        return z * valid.unsqueeze(-1).to(z.dtype)

    def predict(self, model, u: torch.Tensor) -> torch.Tensor:
        """Eq. (6): ``psi(Phi(W_in u)_t)`` for every t — [B, L, Dv], row t predicting latent t + 1."""
        hidden = backbone_hidden(model, self.w_in(u))
        return self.head(hidden.to(self.head.weight.dtype)).float()


def backbone_hidden(model, vectors: torch.Tensor) -> torch.Tensor:
    """Run a family model's layers causally over a sequence of vectors [B, L, d] in place of
    token embeddings -> its final (normed) hidden state [B, L, d]: one document per row, positions
    0..L-1 (padding sits after a row's last kept patch, so causal attention never reads it)."""
    positions = torch.zeros(vectors.shape[:2], dtype=torch.long, device=vectors.device)
    ctx = model.make_context({"tokens": positions})
    return model.final_hidden(*model.run_layers(model.embed_vectors(vectors), ctx))
