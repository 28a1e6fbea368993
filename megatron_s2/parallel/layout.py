"""The parallel layout: sizes, rank grid, groups and stage placement — a pure object.

``ParallelLayout.build`` validates a layout against a world size, a model and the batch
geometry, with messages that say what to change (e.g. "ep=3 does not divide 384 routed
experts"). It allocates nothing and starts no process, so the launcher runs the very same
check at submit time. Process groups are created from it in one place
(:mod:`megatron_s2.parallel.setup`).

Rank order is megatron-core's default ``tp-cp-ep-dp-pp`` for the dense part and
``etp-ep-edp-pp`` for experts (``parallel_state.RankGenerator``), so checkpoints and tools
agree with megatron-core about which rank holds what. The engram-parallel group partitions
Engram table rows (§3.1.3) over ranks that hold the same model shard (same tp and pp
coordinate) along the data x context dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from itertools import product
from typing import TYPE_CHECKING

from megatron_s2.config.model_schema import ModelSchema
from megatron_s2.config.parallel import ParallelConfig
from megatron_s2.config.schema import ConfigError

if TYPE_CHECKING:
    from megatron_s2.config.recipe import RecipeConfig

__all__ = ["ParallelLayout", "rank_groups"]


def rank_groups(sizes: dict[str, int], order: str, token: str) -> list[list[int]]:
    """Groups of ranks varying along the dimensions in ``token`` ("tp", "dp-cp", ...), with
    the first dimension of ``order`` fastest-varying (megatron-core's RankGenerator rule)."""
    dims = order.split("-")
    wanted = token.split("-")
    for w in wanted:
        if w not in dims:
            raise ValueError(f"unknown dimension '{w}' in '{token}' (order {order})")
    strides, stride = {}, 1
    for d in dims:
        strides[d], stride = stride, stride * sizes[d]
    others = [d for d in dims if d not in wanted]
    groups = []
    for other in product(*[range(sizes[d]) for d in reversed(others)]):
        base = sum(i * strides[d] for i, d in zip(other, reversed(others)))
        ranks = []
        for inner in product(*[range(sizes[d]) for d in reversed(wanted)]):
            ranks.append(base + sum(i * strides[d] for i, d in zip(inner, reversed(wanted))))
        groups.append(sorted(ranks))
    return sorted(groups)


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    tp: int
    pp: int
    vpp: int
    cp: int
    dp: int
    ep: int
    etp: int
    edp: int
    engram: int
    sequence_parallel: bool
    distributed_optimizer: bool
    stage_layers: tuple[tuple[int, ...], ...]  # layer ids of each (virtual) stage, model order

    DENSE_ORDER = "tp-cp-dp-pp"
    EXPERT_ORDER = "etp-ep-edp-pp"

    # ---- construction and validation -----------------------------------------------------
    @classmethod
    def from_recipe(cls, recipe: "RecipeConfig", world_size: int, *, batch: bool = True) -> "ParallelLayout":
        """The layout of ``recipe`` on ``world_size`` ranks — the one constructor the trainer, the
        launcher's pre-flight check, the planners and the checkpoint tools share, so they accept
        and refuse exactly the same recipes. ``batch=False`` (tools that only move weights, e.g.
        Hugging Face conversion) skips the sequence-length and batch-geometry checks."""
        if not batch:
            return cls.build(recipe.parallel, recipe.model, world_size)
        t, p = recipe.training, recipe.parallel
        layout = cls.build(p, recipe.model, world_size, seq_length=t.seq_length,
                           global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size)
        window = recipe.model.layout_requirements().cp_min_chunk
        if p.cp > 1 and t.seq_length // (2 * p.cp) < window:  # context_parallel.window_keys_with_halo
            raise ConfigError(f"training.seq_length: {t.seq_length} tokens make 2*cp = {2 * p.cp} context-parallel "
                              f"chunks of {t.seq_length // (2 * p.cp)}, shorter than the attention window ({window}) "
                              f"whose halo each chunk passes on; use seq_length >= {2 * p.cp * window} or fewer CP ranks")
        return layout

    @classmethod
    def build(cls, parallel: ParallelConfig, model: ModelSchema, world_size: int, *,
              seq_length: int | None = None, global_batch_size: int | None = None,
              micro_batch_size: int | None = None) -> "ParallelLayout":
        p = parallel
        m = model
        need = m.layout_requirements()  # the family's parallel plan: what each dimension must divide
        for count, what in need.tp:
            _divides(p.tp, count, f"{count} {what} not divisible by tp={p.tp}", "parallel.tp")
        if p.cp > 1 and need.no_context_parallel:
            raise ConfigError(f"parallel.cp: {need.no_context_parallel}; set cp: 1")
        if p.recompute not in need.recompute:
            raise ConfigError(f"parallel.recompute: {p.recompute} is not implemented by the {m.family} family; use "
                              f"{' or '.join(need.recompute)}")
        if not need.experts and (p.ep > 1 or p.etp > 1):
            raise ConfigError(f"parallel.ep: the model has no routed experts; set ep and etp to 1 (got ep={p.ep}, "
                              f"etp={p.etp})")
        for count, what in need.ep:
            _divides(p.ep, count, f"ep={p.ep} does not divide {count} {what}", "parallel.ep")
        for count, what in need.etp:
            _divides(p.etp, count, f"{count} {what} not divisible by etp={p.etp}", "parallel.etp")
        mp = p.tp * p.pp * p.cp
        if p.dp:
            if world_size != mp * p.dp:
                raise ConfigError(f"parallel: world size {world_size} != tp*pp*cp*dp = "
                                  f"{p.tp}*{p.pp}*{p.cp}*{p.dp} = {mp * p.dp}; change parallel.dp or the number of ranks")
            dp = p.dp
        else:
            if world_size % mp:
                raise ConfigError(f"parallel: world size {world_size} is not divisible by tp*pp*cp = {mp}; "
                                  "launch a multiple of it or change the layout")
            dp = world_size // mp
        dense = p.tp * p.cp * dp
        if dense % (p.etp * p.ep):
            raise ConfigError(f"parallel: etp*ep = {p.etp}*{p.ep} must divide tp*cp*dp = {dense} "
                              "(experts are laid over the same ranks as the dense layers)")
        edp = dense // (p.etp * p.ep)
        if (dp * p.cp) % p.engram_parallel:
            raise ConfigError(f"parallel.engram_parallel: {p.engram_parallel} must divide dp*cp = {dp * p.cp} "
                              "(Engram rows are partitioned over replicas of the same model shard)")
        if p.engram_parallel > 1 and not need.engram:
            raise ConfigError("parallel.engram_parallel: the model has no Engram layers; set it to 1")
        stages = cls._split_layers(p, m)
        if seq_length is not None:
            needs = _sequence_requirements(p.tp, p.cp, p.sequence_parallel)
            for divisor, what, why in needs:
                if seq_length % divisor:
                    raise ConfigError(f"training.seq_length: {seq_length} is not divisible by {what} = {divisor} "
                                      f"({why}); use a multiple of {_lcm_of(needs)}")
        if global_batch_size is not None and micro_batch_size is not None:
            if global_batch_size % (micro_batch_size * dp):
                raise ConfigError(f"training.global_batch_size: {global_batch_size} is not a multiple of "
                                  f"micro_batch_size*dp = {micro_batch_size}*{dp}")
            n_micro = global_batch_size // (micro_batch_size * dp)
            if p.vpp > 1 and n_micro % p.pp:
                raise ConfigError(f"training.global_batch_size: interleaved 1F1B needs the {n_micro} micro-batches "
                                  f"per step to be a multiple of pp={p.pp}")
        return cls(world_size, p.tp, p.pp, p.vpp, p.cp, dp, p.ep, p.etp, edp, p.engram_parallel, p.sequence_parallel,
                   p.distributed_optimizer, stages)

    @staticmethod
    def _split_layers(p: ParallelConfig, m: ModelSchema) -> tuple[tuple[int, ...], ...]:
        n_stages = p.pp * p.vpp
        if p.pipeline_layers:
            total = sum(p.pipeline_layers)
            if total != m.num_layers:
                raise ConfigError(f"parallel.pipeline_layers: {list(p.pipeline_layers)} sums to {total}, "
                                  f"but the model has {m.num_layers} layers")
            counts = list(p.pipeline_layers)
        else:
            if m.num_layers % n_stages:
                raise ConfigError(f"parallel: {m.num_layers} layers do not split evenly over pp*vpp = {n_stages} "
                                  "stages; list the layers per stage in parallel.pipeline_layers")
            if m.num_layers < n_stages:
                raise ConfigError(f"parallel: {m.num_layers} layers cannot fill pp*vpp = {n_stages} stages")
            counts = [m.num_layers // n_stages] * n_stages
        out, start = [], 0
        for c in counts:
            out.append(tuple(range(start, start + c)))
            start += c
        return tuple(out)

    # ---- rank grid -----------------------------------------------------------------------
    @cached_property
    def _dense_sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    @cached_property
    def _expert_sizes(self) -> dict[str, int]:
        return {"etp": self.etp, "ep": self.ep, "edp": self.edp, "pp": self.pp}

    def groups(self, kind: str) -> list[list[int]]:
        """Rank groups of one kind: tp, cp, dp, pp, dp-cp, tp-cp, tp-dp-cp (dense order);
        etp, ep, edp, etp-ep (expert order); engram; embedding (first + last stage)."""
        if kind == "engram":
            return [g[i:i + self.engram] for g in self.groups("dp-cp") for i in range(0, len(g), self.engram)]
        if kind == "embedding":
            return sorted({tuple(sorted({g[0], g[-1]})) for g in self.groups("pp")})
        dims = set(kind.split("-"))
        if dims <= set(self._expert_sizes) and dims & {"etp", "ep", "edp"}:
            return rank_groups(self._expert_sizes, self.EXPERT_ORDER, kind)
        return rank_groups(self._dense_sizes, self.DENSE_ORDER, kind)

    def group_of(self, kind: str, rank: int) -> list[int]:
        for g in self.groups(kind):
            if rank in g:
                return g
        raise ValueError(f"rank {rank} is in no {kind} group")

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index in each dimension."""
        out = {}
        for kind in ("tp", "cp", "dp", "pp", "etp", "ep", "edp", "engram"):
            out[kind] = self.group_of(kind, rank).index(rank)
        return out

    # ---- stage placement -----------------------------------------------------------------
    def stages_of_rank(self, pp_rank: int) -> list[int]:
        """Virtual stage indices held by pipeline rank ``pp_rank`` (interleaved order)."""
        return [v * self.pp + pp_rank for v in range(self.vpp)]

    def stage_of_layer(self, layer: int) -> int:
        for i, layers in enumerate(self.stage_layers):
            if layer in layers:
                return i
        raise ValueError(f"layer {layer} is on no stage")

    # ---- derived sizes ---------------------------------------------------------------------
    @property
    def seq_len_divisor(self) -> int:
        """``training.seq_length`` must be a multiple of this (see :func:`_sequence_requirements`)."""
        return _lcm_of(_sequence_requirements(self.tp, self.cp, self.sequence_parallel))

    def check_frozen_model(self, model: ModelSchema, what: str) -> None:
        """Refuse a frozen model (every layer on each rank, e.g. the Memory Decoder's backbone) that
        this layout's tensor / expert groups cannot split: ``what`` names the recipe key."""
        need = model.layout_requirements()
        for size, key, counts in (("tp", "parallel.tp", need.tp), ("ep", "parallel.ep", need.ep),
                                  ("etp", "parallel.etp", need.etp)):
            k = getattr(self, size)
            for count, thing in counts if k > 1 else ():
                _divides(k, count, f"{size}={k} does not divide the {count} {thing} of {what} "
                                   f"({model.name}); pick a {size} that divides it", key)

    def describe(self) -> str:
        cuts = ", ".join(f"{s[0]}-{s[-1]}" for s in self.stage_layers)
        return (f"world={self.world_size} tp={self.tp}{'+sp' if self.sequence_parallel else ''} pp={self.pp} "
                f"vpp={self.vpp} cp={self.cp} dp={self.dp} ep={self.ep} etp={self.etp} edp={self.edp} "
                f"engram={self.engram}{' zero1' if self.distributed_optimizer else ''} stages=[{cuts}]")


def _sequence_requirements(tp: int, cp: int, sequence_parallel: bool) -> list[tuple[int, str, str]]:
    """(divisor, what it is, why) for every way the layout cuts a sequence."""
    out = []
    if cp > 1:
        out.append((2 * cp, "2*cp", "context parallelism splits each sequence into 2*cp chunks"))
    if tp > 1:
        out.append((tp * cp, "tp*cp", "the MoE layer routes a disjoint 1/tp of each context-parallel rank's tokens "
                                      "on every tensor-parallel rank"))
    if sequence_parallel and tp > 1 and cp > 1:
        out.append((2 * cp * tp, "2*cp*tp", "sequence parallelism splits each context chunk over tp"))
    return out


def _lcm_of(requirements: list[tuple[int, str, str]]) -> int:
    return math.lcm(1, *(d for d, _, _ in requirements))


def _divides(k: int, n: int, message: str, field: str) -> None:
    if n % k:
        raise ConfigError(f"{field}: {message}")
