"""DeepSeek-ViT and the vision-language aligner (report §2.1.1), in the released layout.

Structure, parameter names and semantics follow the public DeepSeek-V4.1-Flash reference
(``inference/vision.py``: ``ViT``, ``PatchEmbed``, ``Attention``, ``MLP``, ``Aligner``; and the
learned ``image_start`` / ``image_end`` / ``image_newline`` of ``inference/model.py``), so released
vision weights import and export under the same tensor names
(:mod:`megatron_s2.models.v41.hf.mapping`):

* **Patch embedding** ``patch_embed.proj``: a *linear* map of each flattened ``3 x p x p`` patch
  (channel-major) to ``vision_dim``, with bias — no convolution, so Muon applies (§2.1.1).
* **Blocks** ``blocks.<i>``: pre-norm residual blocks, ``x + attn(norm1(x))`` then
  ``x + mlp(norm2(x))``, RMSNorm (eps 1e-6, float32 weight); attention is full and bidirectional
  within one image, fused ``wqkv`` and output ``wo`` (both with bias), 2D-RoPE on queries and
  keys (:mod:`.rope2d`), softmax scale ``head_dim^-0.5``; the MLP is SwiGLU without biases,
  ``w2(silu(g) * u)`` with ``[g, u] = w1(x)`` (``w1`` stacks gate over up).
* **Final norm** ``norm``.
* **Aligner** (the MLP projector): the ``r x r`` pixel-unshuffle (the grid zero-padded at the
  bottom and right to multiples of ``r``; each output row is one ``r x r`` neighbourhood,
  channel-major: ``[c, di, dj]``) cuts the tokens ninefold for ``r = 3``, then
  ``w2(gelu(w1(x)))`` (exact GELU, biases) maps ``vision_dim * r^2`` to the backbone width.

The encoder is not part of the backbone's layers: it sits beside the embedding on the first
pipeline stage and is replicated on every rank (the report's disaggregated encoder, §3.1.1).
The training step runs it as its own phases around the LLM (:mod:`.phase`); under context
parallelism each CP rank encodes only the images it owns (:mod:`megatron_s2.parallel.image_sharding`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_s2.models.init import constant_init
from megatron_s2.models.v41.config import V41Config
from megatron_s2.models.v41.norm import RMSNorm
from megatron_s2.models.v41.vision.processor import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START
from megatron_s2.models.v41.vision.rope2d import apply_rope_2d, rope_2d_tables
from megatron_s2.parallel.linear import ReplicatedLinear
from megatron_s2.parallel.placement import mark_param

__all__ = ["VisionEncoder", "VisionTower", "Aligner", "pixel_unshuffle", "merge_image_embeddings"]

VISION_NORM_EPS = 1e-6  # the reference's vision RMSNorm (the backbone uses norm_eps)


class BiasedLinear(ReplicatedLinear):
    """A replicated linear layer with an optional bias (the tower's ``nn.Linear``s)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            mark_param(self.bias, (out_features,), init=constant_init(0.0))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gemm(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, dim: int):
        super().__init__()
        self.proj = BiasedLinear(3 * patch_size * patch_size, dim)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[N, 3, p, p] (or already flat [N, 3 p p]) -> [N, dim]."""
        return self.proj(patches.flatten(1))


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wqkv = BiasedLinear(dim, 3 * dim)
        self.wo = BiasedLinear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        q, k, v = (t.view(n, self.heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
        # every patch sees every patch of its image: no mask
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.wo(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1 = BiasedLinear(dim, 2 * inter_dim, bias=False)  # gate rows, then up rows
        self.w2 = BiasedLinear(inter_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, c: V41Config):
        super().__init__()
        self.norm1 = RMSNorm(c.vision_dim, VISION_NORM_EPS)
        self.attn = VisionAttention(c.vision_dim, c.vision_n_heads)
        self.norm2 = RMSNorm(c.vision_dim, VISION_NORM_EPS)
        self.mlp = VisionMLP(c.vision_dim, c.vision_inter_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class VisionTower(nn.Module):
    """DeepSeek-ViT (the reference's ``ViT``): one image's patches -> patch features."""

    def __init__(self, c: V41Config):
        super().__init__()
        self.head_dim, self.rope_theta = c.vision_dim // c.vision_n_heads, c.vision_rope_theta
        self.patch_embed = PatchEmbed(c.vision_patch_size, c.vision_dim)
        self.blocks = nn.ModuleList([VisionBlock(c) for _ in range(c.vision_n_layers)])
        self.norm = RMSNorm(c.vision_dim, VISION_NORM_EPS)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """[n_h * n_w, 3, p, p] (reading order) -> [n_h * n_w, vision_dim]."""
        if patches.size(0) != n_h * n_w:
            raise ValueError(f"vision tower: {patches.size(0)} patches for a {n_h}x{n_w} grid")
        x = self.patch_embed(patches)
        cos, sin = rope_2d_tables(n_h, n_w, self.head_dim, self.rope_theta, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


def pixel_unshuffle(x: torch.Tensor, n_h: int, n_w: int, ratio: int) -> torch.Tensor:
    """[n_h * n_w, C] grid features -> [ceil(n_h/r) * ceil(n_w/r), C * r * r] neighbourhoods.

    The grid is zero-padded at the bottom and right; output rows are in reading order over the
    coarse grid, each one channel-major ``[c, di, dj]`` (the reference's ``F.unfold`` layout)."""
    c = x.size(-1)
    rows, cols = math.ceil(n_h / ratio), math.ceil(n_w / ratio)
    grid = F.pad(x.view(n_h, n_w, c), (0, 0, 0, cols * ratio - n_w, 0, rows * ratio - n_h))
    grid = grid.view(rows, ratio, cols, ratio, c).permute(0, 2, 4, 1, 3)  # [rows, cols, C, di, dj]
    return grid.reshape(rows * cols, c * ratio * ratio)


class Aligner(nn.Module):
    """The vision-language projector: pixel-unshuffle, then a 2-layer GELU MLP to the backbone width."""

    def __init__(self, c: V41Config):
        super().__init__()
        self.ratio = c.vision_downsample_ratio
        self.w1 = BiasedLinear(c.vision_dim * self.ratio ** 2, c.hidden_size)
        self.w2 = BiasedLinear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(pixel_unshuffle(x, n_h, n_w, self.ratio))))


class VisionEncoder(nn.Module):
    """Tower + aligner + the learned embeddings of the image-span delimiters (``V41Model.vision``)."""

    PLAN_SECTION = "vision"

    def __init__(self, config: V41Config, groups=None):
        super().__init__()
        if not config.vision_n_layers:
            raise ValueError("VisionEncoder: model.vision_n_layers is 0")
        self.config = config
        self.tower = VisionTower(config)
        self.aligner = Aligner(config)
        d = config.hidden_size
        self.image_start = nn.Parameter(torch.empty(d))
        self.image_end = nn.Parameter(torch.empty(d))
        self.image_newline = nn.Parameter(torch.empty(d))
        for p in (self.image_start, self.image_end, self.image_newline):
            mark_param(p, (d,))
        from megatron_s2.models.v41.parallel_plan import apply_plan

        apply_plan(self, groups, config)

    def forward(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        """One image -> its visual embeddings [n_llm_h * n_llm_w, hidden_size] in reading order."""
        return self.aligner(self.tower(patches, n_vit_h, n_vit_w), n_vit_h, n_vit_w)

    def span_embeddings(self, image, dtype: torch.dtype) -> torch.Tensor:
        """The embeddings of one image's whole span [span, hidden_size] (its ``types`` in order)."""
        types = image.types.to(self.image_start.device)
        visual = self(image.patches.to(self.image_start.device), image.n_vit_h, image.n_vit_w)
        if int((types == IMAGE).sum()) != visual.size(0):
            raise ValueError(f"image at {image.start}: {int((types == IMAGE).sum())} IMAGE slots, the "
                             f"{image.n_vit_h}x{image.n_vit_w} patch grid gives {visual.size(0)} embeddings")
        out = visual.new_zeros(types.numel(), visual.size(-1), dtype=dtype)
        out = out.index_put((torch.nonzero(types == IMAGE).squeeze(1),), visual.to(dtype))
        for kind, emb in ((IMAGE_START, self.image_start), (IMAGE_END, self.image_end),
                          (IMAGE_NEW_LINE, self.image_newline)):
            out = torch.where((types == kind).unsqueeze(1), emb.to(dtype), out)
        return out


def merge_image_embeddings(h: torch.Tensor, images, encoder: VisionEncoder) -> torch.Tensor:
    """Token embeddings [b, s, d] with every image span overwritten by its image's embeddings.

    ``images[i]`` lists the :class:`~megatron_s2.models.v41.vision.processor.ImageInput` of
    sequence ``i`` (None or empty for text only). Out of place: gradients reach the encoder
    through the spans and the word embeddings through every other position."""
    rows, cols, values = [], [], []
    for i, sample in enumerate(images):
        for image in sample or ():
            span = encoder.span_embeddings(image, h.dtype)
            if image.start + span.size(0) > h.size(1):
                raise ValueError(f"image span {image.start}..{image.start + span.size(0) - 1} of sequence {i} "
                                 f"runs past its {h.size(1)} positions")
            rows.append(torch.full((span.size(0),), i, device=h.device))
            cols.append(torch.arange(image.start, image.start + span.size(0), device=h.device))
            values.append(span)
    if not values:
        return h
    return h.index_put((torch.cat(rows), torch.cat(cols)), torch.cat(values))

