"""The DSpark drafter: semi-autoregressive drafting with a Markov head and a confidence head
(report §2.4.3; Cheng et al., 2026a).

Structure and semantics follow the public V4.1-Flash reference inference code (its
``DSparkBlock``, ``DSparkAttention``, ``DSparkMarkovHead`` and ``DSparkConfidenceHead``,
stored under the checkpoint's ``mtp.<stage>.*`` namespace), so that released drafter weights
import and export (:mod:`megatron_s2.models.v41.hf.mapping`):

* **Main input.** The backbone's outputs at ``dspark_target_layer_ids`` (each the mean of the
  block's ``hc_mult`` streams) are concatenated and projected, ``main_x =
  main_norm(main_proj(h))``. Every drafter block keeps a 128-token sliding window of *main KV*
  built from ``main_x`` by its own ``wkv`` + ``kv_norm`` + RoPE (no attention norm: the
  reference feeds ``main_x`` to ``wkv`` directly); at prefill the window is seeded from the
  prompt, after each step it receives the newly accepted positions.
* **One forward drafts ``dspark_block_size`` positions in parallel.** With the backbone at
  position ``t`` and the next token ``x_{t+1}`` already chosen, the block input is
  ``[x_{t+1}, noise, ..., noise]`` at positions ``t+1 .. t+K`` (the noise token after the
  first), embedded with the backbone's embedding and repeated over the mHC streams. Each of
  the ``dspark_layers`` blocks is a backbone-style mHC block (attention, then MoE with the
  drafter's own expert counts; classic per-sublayer mixing, the reference's ``hc_pre`` /
  ``hc_post``). Its attention queries the block positions against the main-KV window (``t-W+1
  .. t``) plus all K block positions (no causal mask inside the block). The streams are
  collapsed by ``hc_head`` and the backbone's head gives **base logits** for positions
  ``t+2 .. t+K+1``.
* **Markov head.** Draft position ``i`` adds the bias ``markov_w2(markov_w1[prev_i])`` of the
  previous token (the seed for ``i = 0``, then the token drafted at ``i - 1``): a low-rank
  V x V transition, applied sequentially while drafting, in parallel under teacher forcing.
* **Confidence head** (float32): ``proj([x_i, markov_w1[prev_i]])`` is the logit of position
  ``i``'s conditional acceptance probability; their running product is the probability that
  the whole prefix survives verification, which the scheduler weighs against the engine's
  throughput (:mod:`megatron_s2.inference.speculative`).

The backbone's embedding and head are *shared, never trained through the drafter*: the
drafter reads their weights detached, so no gradient from the drafter objective reaches the
backbone (§2.4.3: "without propagating gradients from the DSpark objective into the
backbone"). Under tensor parallelism the drafter's attention heads and experts shard like the
backbone's and its logits are gathered to the full vocabulary. Under context parallelism each
rank drafts from the anchors of its own sequence chunks (:meth:`DSparkDrafter.teacher_forced`'s
``anchors`` / ``main_rows``); its draft blocks are never sequence- or context-sharded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_s2.models.init import constant_init, normal_init
from megatron_s2.models.v41.config import V41Config
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.layer_plan import CSA2Mode, LayerPlan, LayerSpec
from megatron_s2.models.v41.mhc import collapse, expand_embedding
from megatron_s2.models.v41.norm import RMSNorm
from megatron_s2.models.v41.rope import apply_rope
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.linear import ReplicatedLinear
from megatron_s2.parallel.placement import mark_param

__all__ = ["DSparkDrafter", "DraftForward", "drafter_config"]


def drafter_config(config: V41Config) -> V41Config:
    """The configuration the drafter's blocks are built from: the backbone's, with the
    drafter's own expert counts."""
    return config.replace(num_routed_experts=config.dspark_num_routed_experts, moe_topk=config.dspark_moe_topk)


def _stage_spec(config: V41Config, stage: int) -> LayerSpec:
    """A sliding-window, uncompressed layer (the reference's ``compress_ratio = 0``) indexed after
    the backbone, so routing records and parameter names never collide with backbone layers."""
    return LayerSpec(index=config.num_layers + stage, mode=CSA2Mode.SWA, compress_ratio=0, is_encoder=False,
                     kv_source=None, index_source=None, candidate_source=None, is_candidate_source=False,
                     uses_encoder_output=False, has_engram=False)


@dataclass
class DraftForward:
    """What one drafter forward returns for ``N`` blocks of ``K`` positions."""

    hidden: torch.Tensor
    """[N, K, d] the collapsed streams (``hc_head``), before the final norm."""
    base_logits: torch.Tensor
    """[N, K, V] float32, full vocabulary, without the Markov bias."""
    aux_loss: torch.Tensor | None = None
    """The drafter MoEs' balance loss (training only)."""


class DSparkDrafter(nn.Module):
    PLAN_SECTION = "dspark"

    def __init__(self, config: V41Config, groups: ParallelGroups, provider):
        super().__init__()
        from megatron_s2.models.v41.block import V41Block
        from megatron_s2.models.v41.spec import block_spec

        if not config.dspark_layers:
            raise ValueError("DSparkDrafter: model.dspark_layers is 0")
        self.config, self.groups = config, groups
        d, n, r = config.hidden_size, config.hc_mult, config.dspark_markov_rank
        self.block_size, self.noise_token_id = config.dspark_block_size, config.dspark_noise_token_id
        self.target_layers = tuple(config.dspark_target_layer_ids)
        self.window = config.window_size
        self.main_proj = ReplicatedLinear(d * len(self.target_layers), d)
        self.main_norm = RMSNorm(d, config.norm_eps)
        dcfg = drafter_config(config)
        spec = block_spec(provider)
        self.blocks = nn.ModuleDict()
        for stage in range(config.dspark_layers):
            s = _stage_spec(config, stage)
            self.blocks[str(stage)] = V41Block(dcfg, s, groups, spec.submodules)
        self.final_norm = RMSNorm(d, config.norm_eps)
        # hc_head: the reference's final stream collapse with its own predictor (float32)
        self.head_hc_fn = nn.Parameter(torch.empty(n, n * d, dtype=torch.float32))
        self.head_hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.head_hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))
        mark_param(self.head_hc_fn, (n, n * d), init=normal_init(config.init_std))
        mark_param(self.head_hc_base, (n,), init=constant_init(0.0))
        mark_param(self.head_hc_scale, (1,), init=constant_init(0.01))
        self.markov_w1 = nn.Parameter(torch.empty(config.vocab_size, r))
        self.markov_w2 = nn.Parameter(torch.empty(config.vocab_size, r))
        # the Markov bias starts at zero: drafting begins from the base logits alone
        mark_param(self.markov_w1, (config.vocab_size, r), init=normal_init(config.init_std))
        mark_param(self.markov_w2, (config.vocab_size, r), init=constant_init(0.0))
        self.confidence = nn.Parameter(torch.empty(1, d + r, dtype=torch.float32))
        mark_param(self.confidence, (1, d + r), init=constant_init(0.0))
        self._plan = LayerPlan.from_config(dcfg)
        from megatron_s2.models.v41.parallel_plan import apply_plan

        apply_plan(self, groups, config)

    # ---- pieces ------------------------------------------------------------------------------
    def main_input(self, targets: torch.Tensor) -> torch.Tensor:
        """[..., d * targets] concatenated target-layer outputs -> ``main_x`` [..., d]."""
        return self.main_norm(self.main_proj(targets))

    def main_kv(self, stage: int, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Block ``stage``'s window key/value of main positions: ``rope(kv_norm(wkv(main_x)))``."""
        attn = self.blocks[str(stage)].attention
        # enter the tp region: the window keys feed only this rank's heads, so main_x's gradient sums over tp
        kv = attn.kv_norm(attn.linear_kv(attn.seq.enter_local(main_x.float())))
        return apply_rope(kv, positions, attn.inv_freq)

    def head_collapse(self, x: torch.Tensor) -> torch.Tensor:
        """``hc_head``: streams [N, K, n, d] -> [N, K, d] with sigmoid mixing weights."""
        xf = x.float().flatten(-2)
        rsqrt = torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.config.norm_eps)
        mixes = (xf @ self.head_hc_fn.t()) * rsqrt
        pre = torch.sigmoid(mixes * self.head_hc_scale + self.head_hc_base) + self.config.hc_eps
        return collapse(x, pre)

    def markov(self, prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Previous tokens [...] -> (logit bias [..., V] float32, Markov embedding [..., r])."""
        embed = self.markov_w1[prev_ids]
        return F.linear(embed.float(), self.markov_w2.float()), embed

    def confidence_logits(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """[N, K, d] + [N, K, r] -> [N, K] logits of the conditional acceptance probability."""
        return F.linear(torch.cat([hidden.float(), markov_embed.float()], -1), self.confidence).squeeze(-1)

    # ---- the drafter forward -------------------------------------------------------------------
    def block_inputs(self, seeds: torch.Tensor) -> torch.Tensor:
        """[N] seed tokens -> [N, K] block ids ``[seed, noise, ..., noise]``."""
        ids = seeds.new_full((seeds.size(0), self.block_size), self.noise_token_id)
        ids[:, 0] = seeds
        return ids

    def forward_blocks(self, block_ids: torch.Tensor, positions: torch.Tensor, main_keys: list[torch.Tensor],
                       main_valid: torch.Tensor, embed, head, aux_rows: torch.Tensor | None = None) -> DraftForward:
        """Run the blocks over ``N`` draft blocks.

        ``block_ids`` / ``positions`` [N, K]; ``main_keys[stage]`` [N, W', hd] the main-KV window
        of each block; ``main_valid`` [N, W'] which window keys exist (same document, not before
        position 0). ``embed`` / ``head``: the backbone's embedding (ids -> [N, K, d]) and head
        ([N, K, d] -> full-vocabulary float32 logits), both with detached weights. ``aux_rows`` [N]
        bool: the blocks the drafter MoEs' balance loss sees (None: all)."""
        n_blocks, k = block_ids.shape
        w = main_valid.size(1)
        dev = block_ids.device
        # every query sees the valid window keys and every position of its own block
        window_idx = torch.where(main_valid, torch.arange(w, device=dev), -1)
        idx = torch.cat([window_idx, torch.arange(w, w + k, device=dev).expand(n_blocks, k)], dim=1)
        idx = idx.unsqueeze(1).expand(n_blocks, k, w + k)
        ctx = ForwardContext.create(block_ids, self._plan, positions=positions)
        ctx.aux_rows = aux_rows
        x = expand_embedding(embed(block_ids).to(getattr(torch, self.config.compute_dtype)), self.config.hc_mult)
        for stage, block in enumerate(self.blocks.values()):
            def attention(h, block=block, stage=stage):
                return self._attend(block.attention, h, positions, main_keys[stage], idx)

            x, _ = block.attn_hc(x, lambda h: attention(block.attn_norm(h)))
            x, _ = block.mlp_hc(x, lambda h: block.mlp(block.mlp_norm(h), ctx))
        hidden = self.head_collapse(x)
        logits = head(self.final_norm(hidden))
        return DraftForward(hidden, logits, ctx.total_aux_loss())

    @staticmethod
    def _attend(attn, x: torch.Tensor, positions: torch.Tensor, main_keys: torch.Tensor,
                idx: torch.Tensor) -> torch.Tensor:
        """The block's queries against [main-KV window, own block keys] in one softmax with the
        sink (the backbone's attention core, :meth:`CSA2Attention.attend`)."""
        x_in = attn.seq.enter_local(x)
        qr = attn.compressed_query(x_in)
        own = attn.window_kv(x_in, positions, quantise=False)
        keys = torch.cat([main_keys.to(own.dtype), own], dim=1)
        out, _ = attn.attend(qr, keys, lambda sl: idx[:, sl], None, keys.size(1), positions, None)
        return out

    # ---- teacher-forced training forward ---------------------------------------------------------
    def teacher_forced(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor,
                       doc_ids: torch.Tensor | None, embed, head, *, anchors: torch.Tensor | None = None,
                       main_rows: torch.Tensor | None = None, aux_rows: torch.Tensor | None = None) -> "TeacherForced":
        """Every anchor ``t`` of ``tokens`` [B, S] as one draft block (backbone at ``t``, seed
        ``tokens[t+1]``): returns draft logits (base + Markov bias of the true previous tokens),
        confidence logits and which (anchor, position) pairs have a target inside the document.

        Draft position ``i`` of anchor ``t`` predicts the token at ``t+2+i``; its target is the
        backbone's distribution at row ``t+1+i``. ``targets`` [B, R, d * n_targets] (detached):
        the recorded target layers at the sequence rows ``main_rows`` [R] (None: all S rows in
        order; a row < 0 is padding). ``anchors`` [A]: the anchors to draft from (None: every row
        with a seed, 0 .. S-2). Under context parallelism a rank passes the whole sequence's
        ``tokens`` / ``positions`` / ``doc_ids``, its own anchors and the target rows of its
        chunks with their window halo (:func:`~megatron_s2.parallel.context_parallel.window_keys_with_halo`).
        ``aux_rows`` [B] bool: the rows whose blocks the drafter MoEs' balance loss sees (a
        post-training filler row's do not; None: all)."""
        b, s = tokens.shape
        k, w, dev = self.block_size, self.window, tokens.device
        if anchors is None:
            anchors = torch.arange(s - 1, device=dev)                            # every anchor with a seed
        a = anchors.numel()
        block_pos_off = torch.arange(1, k + 1, device=dev)   # positions t+1 .. t+K
        rows = (anchors.unsqueeze(1) + block_pos_off).clamp_max(s - 1)          # [A, K] token rows
        prev = tokens[:, rows]                                                    # [B, A, K] true prev tokens
        doc = doc_ids if doc_ids is not None else torch.zeros_like(tokens)
        anchor_doc = doc[:, anchors].unsqueeze(-1)
        same_doc = doc[:, rows] == anchor_doc
        # position i is trained when row t+1+i exists and lies in the anchor's document
        in_seq = (anchors.unsqueeze(1) + block_pos_off) <= s - 1
        valid = same_doc & in_seq.unsqueeze(0)                                   # [B, A, K]
        # the main-KV window of each anchor: rows t-W+1 .. t of the same document
        win = (anchors.unsqueeze(1) - w + 1 + torch.arange(w, device=dev))         # [A, W]
        main_valid = (win >= 0).unsqueeze(0) & (doc[:, win.clamp_min(0)] == anchor_doc)
        if main_rows is None:                                                    # targets row r holds row r
            win_slot, main_positions = win.clamp_min(0), positions
        else:                                                                    # look each window row up
            slot_of = torch.zeros(s, dtype=torch.long, device=dev)
            held = main_rows >= 0
            slot_of[main_rows[held]] = torch.arange(main_rows.numel(), device=dev)[held]
            win_slot, main_positions = slot_of[win.clamp_min(0)], positions[:, main_rows.clamp_min(0)]
        main_x = self.main_input(targets)                                        # [B, R, d]
        main_keys = []
        for stage in range(len(self.blocks)):
            kv = self.main_kv(stage, main_x, main_positions)                     # [B, R, hd]
            main_keys.append(kv[:, win_slot].flatten(0, 1))                      # [B*A, W, hd]
        seeds = tokens[:, anchors + 1].reshape(-1)
        block_ids = self.block_inputs(seeds)                                     # [B*A, K]
        block_positions = (positions[:, anchors].unsqueeze(-1) + block_pos_off).flatten(0, 1)
        block_rows = None if aux_rows is None else aux_rows.to(dev, torch.bool).repeat_interleave(a)  # [B*A]
        out = self.forward_blocks(block_ids, block_positions, main_keys, main_valid.flatten(0, 1), embed, head,
                                  aux_rows=block_rows)
        bias, m_embed = self.markov(prev.flatten(0, 1))
        logits = out.base_logits + bias
        confidence = self.confidence_logits(out.hidden, m_embed)
        return TeacherForced(logits.view(b, a, k, -1), confidence.view(b, a, k), valid, rows, out.aux_loss)


@dataclass
class TeacherForced:
    logits: torch.Tensor
    """[B, A, K, V] draft logits (base + Markov bias), float32."""
    confidence: torch.Tensor
    """[B, A, K] confidence logits."""
    valid: torch.Tensor
    """[B, A, K] positions with a target in the anchor's document."""
    target_rows: torch.Tensor
    """[A, K] the backbone row whose distribution is position i's target (t + 1 + i)."""
    aux_loss: torch.Tensor | None
