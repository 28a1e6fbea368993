"""What an RL / OPD rank holds beside its training state (report §5.2.1: rollouts co-located on the
training ranks and time-shared).

The training state and activations of ``phase.kind: rl | opd`` are those of any phase
(:mod:`.memory`); on top, every rank keeps resident for the whole run:

* the **rollout weight copy** — only when the engine cannot run the training model in place
  (:func:`~megatron_s2.posttrain.rollout.weights.rollout_placement`: pp, cp or sequence
  parallelism in the training layout, or ``share_weights: never``). It is the model under the
  rollout layout (training tp, ``rollout_ep``, ``rollout_engram_parallel``, pp = cp = 1) after
  ``apply_precision_map`` (``params_dtype`` matrices, float32 islands), counted on a meta
  skeleton of that layout;
* the **KV cache of each engine** — the rollout engine and the held-out evaluation engine (none
  for verifiers environments, evaluated through the rollout engine) build their own page pool
  and SWA rings (:func:`~megatron_s2.config.posttrain.engines.engine_configs`), sized by the
  family's ``engine_cache_bytes``, the function with which the
  engine refuses a cache that does not fit. Pages are not sharded by tensor parallelism (one
  latent KV vector per token and layer), so every rank holds its replica's whole pool;
* **frozen models** (:mod:`megatron_s2.posttrain.frozen`) — OPD in-process teachers and the
  ``reference_kl`` reference, each with the architecture saved in its checkpoint (read from the
  checkpoint's manifest or ``config.json``, no tensors) on the rollout layout's tensor / expert
  groups, in their precision map. A checkpoint that is not readable when planning (not written
  yet) is counted with the teacher's ``model`` recipe if it names one, else the policy's
  architecture, and the line says so.

The Memory Decoder's phases (``phase.kind: memdec | memdec_router``, walkthrough Ch. 2) keep their
**frozen backbone** (``phase.memdec_backbone``) resident the same way: every layer on each rank,
with the training layout's tensor / expert groups (:mod:`megatron_s2.posttrain.memdec`: its routed
experts split over ep, 1/ep of them per rank), its architecture read from the checkpoint; one that
is not readable yet is counted with ``phase.memdec_backbone_model`` when the recipe names one, else
not counted, and the line says so. On the last pipeline stage, where the
objectives run, every tensor-parallel rank also holds their **whole-vocabulary working set** (the
memory's gathered logits, the kNN distribution, Eq. 2's or Eq. 3-4's log-probabilities and their
backward): ``MEMDEC_OBJECTIVE_BYTES`` per position and vocabulary entry, measured by
bench/memdec_objective_bytes.py, times micro_batch_size x seq_length x vocab_size. The kNN datastore
lives in host memory (the search streams it to the GPU chunk by chunk) and is not counted.

Not counted: the engines' per-step working set while generating (it is freed before training),
and the weight transfer's bucket (transient, at most ``bucket_mb``).
"""

from __future__ import annotations

from pathlib import Path

from megatron_s2.config.model_schema import ModelSchema
from megatron_s2.config.recipe import RecipeConfig
from megatron_s2.parallel.layout import ParallelLayout

__all__ = ["posttrain_resident", "memdec_resident", "frozen_model_bytes", "checkpoint_model_config",
           "MEMDEC_OBJECTIVE_BYTES"]

MEMDEC_OBJECTIVE_BYTES = {"memdec": 24, "memdec_router": 44}
"""Peak working set of each Memory Decoder objective per position and vocabulary entry (bytes),
measured by bench/memdec_objective_bytes.py (24.1 and 44.3 on CPU, float32)."""


_BYTES: dict[tuple, int] = {}


def frozen_model_bytes(cfg: ModelSchema, groups) -> int:
    """Bytes of a whole model (every layer) held by the rank of ``groups``, stored as the rollout
    model and frozen models store it (``apply_precision_map``): parameters and buffers."""
    from megatron_s2.models.family.skeleton import model_skeleton

    key = (cfg, groups.sequence_parallel) + tuple((getattr(groups, f).size, getattr(groups, f).rank)
                                                  for f in ("tp", "ep", "etp", "engram"))
    if key not in _BYTES:
        model = model_skeleton(cfg, groups)
        model.apply_precision_map()
        tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
        _BYTES[key] = sum(t.numel() * t.element_size() for t in tensors.values())
    return _BYTES[key]


def checkpoint_model_config(path: str | Path) -> ModelSchema | None:
    """The architecture saved with a checkpoint (a sharded run / checkpoints / step directory, or
    a Hugging Face export), read without its tensors; None when there is none readable."""
    from megatron_s2.checkpoint.format import CheckpointError
    from megatron_s2.config.schema import ConfigError, from_mapping

    path = Path(path)
    try:
        if (path / "config.json").is_file():
            from megatron_s2.checkpoint.hf.convert import read_config_json
            from megatron_s2.models.family.registry import family_for_hf_config

            data = read_config_json(path)
            return family_for_hf_config(data).hf.config_from_hf(data)
        from megatron_s2.checkpoint.offline import resolve_step_dir
        from megatron_s2.checkpoint.store import read_manifest

        manifest = read_manifest(resolve_step_dir(path, log=lambda *a: None))
        return from_mapping(RecipeConfig, manifest.config, f"{path}: checkpoint.json config").model
    except (CheckpointError, ConfigError, OSError, ValueError):
        return None


def _frozen_config(recipe: RecipeConfig, path: str, model_ref: str = "") -> tuple[ModelSchema, str]:
    """(architecture, where it came from) of a frozen model loaded from ``path``."""
    cfg = checkpoint_model_config(path) if path else None
    if cfg is not None:
        return cfg, "checkpoint's model"
    # Planned before the checkpoint exists (a flagship plan before SFT ran), or unreadable here.
    why = "no checkpoint given" if not path else \
        f"{path} {'not found' if not Path(path).exists() else 'not readable'}"
    if model_ref:
        from megatron_s2.config.recipe import _resolve_model
        from megatron_s2.config.schema import from_mapping

        return from_mapping(ModelSchema, _resolve_model(model_ref, Path.cwd()), f"model {model_ref}"), \
            f"model {model_ref} assumed: {why}"
    return recipe.model, f"policy's model assumed: {why}"


def _dtype(cfg: ModelSchema) -> str:
    return "bf16+fp32 islands" if cfg.params_dtype == "bfloat16" else "fp32"


def posttrain_resident(recipe: RecipeConfig, layout: ParallelLayout, rank: int) -> dict[str, float]:
    """``{label: bytes}`` of what ``rank`` holds for rollouts and frozen models (module docstring);
    empty for pretrain / sft phases."""
    from megatron_s2.parallel.offline_groups import layout_groups
    from megatron_s2.models.family import family_of
    from megatron_s2.config.posttrain.recipe_checks import posttrain_section
    from megatron_s2.config.posttrain.engines import engine_configs
    from megatron_s2.parallel.rollout_layout import rollout_placement

    section = posttrain_section(recipe)
    if section is None:
        return {}
    placement = rollout_placement(recipe, layout, layout.world_size)
    groups = layout_groups(placement.layout, rank)
    lay = placement.layout
    where = f"tp={lay.tp} ep={lay.ep} etp={lay.etp} engram={lay.engram}"
    out: dict[str, float] = {}
    if not placement.shared:
        out[f"rollout weight copy ({where}; {_dtype(recipe.model)})"] = frozen_model_bytes(recipe.model, groups)
    for name, engine in engine_configs(recipe, section.rollout).items():
        label = f"{engine.max_num_seqs} seqs x {engine.max_model_len} tokens, {engine.num_pages_total} pages"
        out[f"{name} engine KV ({label})"] = family_of(recipe.model).engine_cache_bytes(recipe.model, engine)
    if recipe.phase.kind == "opd":
        for t in section.teachers:
            if t.checkpoint:
                cfg, source = _frozen_config(recipe, t.checkpoint, t.model)
                out[f"teacher {t.name} ({source}; {where}; {_dtype(cfg)})"] = frozen_model_bytes(cfg, groups)
    if section.loss.has_term("reference_kl"):
        path = getattr(section, "reference_checkpoint", "") or recipe.checkpoint.load
        cfg, source = _frozen_config(recipe, path)
        out[f"reference model ({source}; {where}; {_dtype(cfg)})"] = frozen_model_bytes(cfg, groups)
    return out


def memdec_resident(recipe: RecipeConfig, layout: ParallelLayout, rank: int) -> dict[str, float]:
    """``{label: bytes}`` of the Memory Decoder's frozen backbone on ``rank`` (module docstring);
    empty for other phases. A backbone checkpoint not written yet is counted with
    ``phase.memdec_backbone_model`` when the recipe names one."""
    from megatron_s2.parallel.offline_groups import layout_groups, pp_rank_of

    kind = recipe.phase.kind
    if kind not in ("memdec", "memdec_router"):
        return {}
    out = {}
    if pp_rank_of(layout, rank) == layout.pp - 1:  # the objectives run on the last stage
        t = recipe.training
        entries = t.micro_batch_size * t.seq_length * recipe.model.vocab_size
        out[f"memdec objective working set ({MEMDEC_OBJECTIVE_BYTES[kind]} B x {t.micro_batch_size} x "
            f"{t.seq_length} tokens x {recipe.model.vocab_size} vocabulary)"] = float(MEMDEC_OBJECTIVE_BYTES[kind] * entries)
    path, model_ref = recipe.phase.memdec_backbone, recipe.phase.memdec_backbone_model
    where = f"every layer, tp={layout.tp} ep={layout.ep} etp={layout.etp}"
    if checkpoint_model_config(path) is None and not model_ref:
        why = "not found" if not Path(path).exists() else "not readable"
        return {f"memdec frozen backbone (NOT COUNTED: {path} {why})": 0.0, **out}
    cfg, source = _frozen_config(recipe, path, model_ref)
    layout.check_frozen_model(cfg, "phase.memdec_backbone")
    label = f"memdec frozen backbone ({cfg.name}; {source}; {where}; {_dtype(cfg)})"
    out = {label: frozen_model_bytes(cfg, layout_groups(layout, rank)), **out}
    if kind == "memdec_router" and pp_rank_of(layout, rank) == layout.pp - 1:
        out["memdec router (trained, whole: float32 parameters, gradients, AdamW state)"] = \
            _router_bytes(recipe, cfg.hidden_size)
    return out


def _router_bytes(recipe: RecipeConfig, backbone_hidden: int) -> float:
    """The router the last stage trains (the memory decoder itself is frozen in this phase and
    counted without gradients or optimiser state, :func:`~.memory.rank_memory`)."""
    from megatron_s2.models.family.skeleton import SkeletonMode
    from megatron_s2.models.memory_decoder.router import MemoryRouter
    from megatron_s2.planning.model_state import ADAM_STEP_BYTES

    with SkeletonMode():
        router = MemoryRouter(backbone_hidden, recipe.model.hidden_size, recipe.phase.memdec_router_init_lambda,
                              recipe.phase.memdec_router_hidden)
    numel = sum(p.numel() for p in router.parameters())
    return float(numel * 4 * 4 + ADAM_STEP_BYTES)  # parameter, gradient, exp_avg, exp_avg_sq
