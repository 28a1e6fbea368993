"""Every check a run makes before it allocates anything, in one function for trainer and launcher.

:func:`check_run_inputs` is called by the trainer at start-up (every rank, before the model is
built) and by ``megatron-s2 launch`` before any rank starts or any job is queued, so that a run
refused by the trainer is refused at submit time with the same message:

1. the run directory: not a file, writable (or creatable);
2. the tokenizer against the model's vocabulary;
3. the data files (``data.paths``): present, readable indexes, written with this vocabulary;
4. ``checkpoint.load``: a directory that holds a committed checkpoint (or, in a pipeline, lies in
   the run directory of an earlier phase, which writes it first); skipped when the run resumes
   from its own checkpoints instead;
5. memory: the per-rank plan of ``megatron-s2 plan memory`` (:mod:`megatron_s2.planning.memory`)
   against what this host offers — host memory shared by its CPU ranks, or one GPU per rank.
   Skipped where the host is unknown (``launch --slurm`` submits from a login node) or when
   ``training.memory_check`` is false. The plan leaves out the framework's own overhead, so
   it only refuses runs that cannot fit, such as a sequence length typed with extra zeros.

Every refusal is a :class:`ConfigError` naming the field and the fix (exit code 2).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from megatron_s2.config.recipe import RecipeConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.data.errors import DataError

from megatron_s2.runtime.host_memory import GiB, HostMemory

__all__ = ["HostMemory", "check_run_inputs", "check_run_dir", "check_data", "check_image_layout", "check_checkpoint_load", "check_memory",
           "check_rank_memory"]


def check_run_dir(run_dir: str | Path) -> None:
    """The run directory can hold the run: an existing writable directory, or creatable."""
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"training.run_dir: {path} exists and is not a directory; choose another --run-dir")
    probe = path
    while not probe.exists():  # the nearest existing ancestor must accept the new directory
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"training.run_dir: {path} cannot be created ({probe} is not a directory); "
                          "choose another --run-dir")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == path else f"cannot be created ({probe} is not writable)"
        raise ConfigError(f"training.run_dir: {path} {what}; choose another --run-dir or fix its permissions")


def check_tokenizer(recipe: RecipeConfig):
    """The tokenizer the run will use; it must fit the model (vocabulary, Engram pad id)."""
    from megatron_s2.data.tokenizer import build_tokenizer
    from megatron_s2.data.tokenizer_checks import check_tokenizer_fits

    try:
        tokenizer = build_tokenizer(recipe.data)
    except DataError as exc:
        raise ConfigError(f"data.{exc}") from None
    check_tokenizer_fits(tokenizer, recipe.model, f"data.tokenizer={recipe.data.tokenizer}")
    return tokenizer


def check_data(recipe: RecipeConfig, tokenizer) -> None:
    """Every dataset of ``data.paths`` is there: indexed prefixes open (index checked) and were
    written with this tokenizer's vocabulary; chat files exist and are readable."""
    from megatron_s2.data.indexed_dataset import IndexedDataset
    from megatron_s2.data.records import resolve_local_path

    if recipe.data.kind == "image_text":  # images are decoded (and refused by name) when the data is built
        for name in recipe.data.paths:
            path = Path(name)
            ok = path.is_dir() if recipe.data.source == "folder" else path.is_file() and os.access(path, os.R_OK)
            if not ok:
                what = "a directory of images" if recipe.data.source == "folder" else "a readable file"
                raise ConfigError(f"data.paths: {name} is not {what} (data.source: {recipe.data.source})")
        return
    if recipe.data.kind == "timeseries":  # local series files, read and checked whole (NaN, ragged, size)
        from megatron_s2.data.timeseries import load_series

        for name in recipe.data.paths:
            try:
                load_series(name)
            except DataError as exc:
                raise ConfigError(f"data.paths: {exc}") from None
        return
    if recipe.data.kind == "chat":
        for name in recipe.data.paths:
            path = resolve_local_path(name)
            if not path.is_file() or not os.access(path, os.R_OK):
                raise ConfigError(f"data.paths: {name} is not a readable file; give the .jsonl or .parquet "
                                  "conversations to train on")
        return
    for prefix in recipe.data.paths:
        try:
            dataset = IndexedDataset(prefix)
        except DataError as exc:
            raise ConfigError(f"data.paths: {exc}") from None
        if dataset.vocab_size != tokenizer.vocab_size:
            raise ConfigError(f"data.paths: {prefix}.idx was written with a {dataset.vocab_size}-token vocabulary "
                              f"but the '{recipe.data.tokenizer}' tokenizer has {tokenizer.vocab_size}; "
                              "re-run tools/preprocess_data.py")


def check_image_layout(recipe: RecipeConfig) -> None:
    """Image data (``data.kind: image_text``) needs a model with a vision pathway, and no DSpark
    drafter training (the drafter trains on text data). Every parallel layout carries images:
    context parallelism shards them across the CP ranks (:mod:`megatron_s2.parallel.image_sharding`),
    under sequence parallelism each tp rank writes its slice's span rows
    (:func:`megatron_s2.models.v41.vision.phase.merge_images`)."""
    if recipe.data.kind != "image_text":
        return
    from megatron_s2.models.family import family_of

    if family_of(recipe.model).image_processor(recipe.model) is None:
        raise ConfigError("data.kind: 'image_text' needs a model with a vision tower; set model.vision_n_layers "
                          "(and the other vision_* fields) or use text data")
    if recipe.phase.trains_drafter:
        raise ConfigError(f"data.kind: 'image_text' with a phase that trains the DSpark drafter is not supported; "
                          "train the drafter on text data")


def check_series_layout(recipe: RecipeConfig) -> None:
    """The time-series lane (``data.kind: timeseries``, ``phase.kind: timeseries_forecast``; Intern-S2
    report §2.2) needs ``model.timeseries``. It runs under dp, tp (+sp), pp and ep: the encoder and
    the forecaster are whole replicas beside the first stage's embedding and the last stage's head
    (the forecaster's stage encodes with a replica of the encoder, :mod:`megatron_s2.models.timeseries.replica`),
    reduced over the data-parallel group like every dense parameter while the backbone's experts
    split over ep. Context parallelism would cut a series span between chunks, and expert tensor
    parallelism is untested with the lane: both are refused."""
    series_data, forecast = recipe.data.kind == "timeseries", recipe.phase.kind == "timeseries_forecast"
    if not (series_data or forecast):
        return
    what = "phase.kind: timeseries_forecast" if forecast else "data.kind: 'timeseries'"
    if forecast and not series_data:
        raise ConfigError(f"data.kind: phase.kind timeseries_forecast trains on series with known futures; set "
                          f"data.kind: timeseries (got '{recipe.data.kind}')")
    ts = getattr(recipe.model, "timeseries", None)
    if ts is None:
        raise ConfigError(f"model.timeseries: {what} needs the model's time-series encoder; add a model.timeseries "
                          "section (e.g. {hidden: 64, token_budget: 64})")
    ts.placeholder_id(recipe.model.vocab_size)
    p = recipe.parallel
    why = {"cp": "context parallelism would cut a series span between chunks",
           "etp": "expert tensor parallelism is untested with the series lane"}
    for name, reason in why.items():
        if getattr(p, name) > 1:
            raise ConfigError(f"parallel.{name}: {what} runs under dp, tp (+sequence_parallel), pp and ep, not "
                              f"{name}={getattr(p, name)} ({reason}); set parallel.{name}: 1")
    if recipe.phase.trains_drafter:
        raise ConfigError(f"{what} with a phase that trains the DSpark drafter is not supported; train the drafter "
                          "on text data")


def check_memdec_layout(recipe: RecipeConfig) -> None:
    """The Memory Decoder's phases (``phase.kind: memdec`` / ``memdec_router``, walkthrough Ch. 2)
    run under dp, tp (+ sequence parallelism), pp and ep (megatron_s2/posttrain/memdec/trainer.py):
    the frozen backbone takes the layout's tensor and expert groups (its experts split over ep, as a
    flagship backbone needs). The datastore lookup and the router read whole sequences, so context
    parallelism is refused; expert tensor parallelism is refused until the phases are parity-tested
    under it."""
    if recipe.phase.kind not in ("memdec", "memdec_router"):
        return
    p = recipe.parallel
    if p.cp > 1:
        raise ConfigError(f"parallel.cp: phase.kind {recipe.phase.kind} runs under dp, tp, pp and ep, not context "
                          f"parallelism (got cp={p.cp}); set parallel.cp: 1")
    if p.etp > 1:
        raise ConfigError(f"parallel.etp: phase.kind {recipe.phase.kind} runs under dp, tp, pp and ep, not "
                          f"etp={p.etp} (expert tensor parallelism is untested with the Memory Decoder); "
                          "set parallel.etp: 1")


def check_checkpoint_load(recipe: RecipeConfig, run_dir: str | Path, pending: Sequence[str | Path] = ()) -> None:
    """``checkpoint.load`` names a loadable checkpoint, unless the run will resume from its own
    (``checkpoint.resume`` and a committed step in ``run_dir``: ``load`` is then not read) or the
    path lies in ``pending`` (run directories of earlier phases of a pipeline, module docstring)."""
    from megatron_s2.checkpoint.locate import checkpoint_problem, may_be_created

    ck = recipe.checkpoint
    if not ck.load or may_be_created(ck.load, pending):
        return
    if ck.resume and checkpoint_problem(run_dir) is None:
        return
    problem = checkpoint_problem(ck.load)
    if problem:
        raise ConfigError(f"checkpoint.load: {problem}; give a run, checkpoints or step directory of a saved run")
    check_served_drafter(recipe)


def check_served_drafter(recipe: RecipeConfig) -> None:
    """Disaggregated RL with ``rl.rollout.engine.speculative``: the inference servers load
    ``checkpoint.load`` with the architecture saved in it (not the recipe's), so that one must
    carry the drafter — else every server stops at start-up (review57)."""
    from megatron_s2.planning.posttrain import checkpoint_model_config

    rl = getattr(recipe, "rl", None)
    if recipe.phase.kind != "rl" or rl is None or rl.mode != "disaggregated" or not rl.rollout.engine.speculative:
        return
    saved = checkpoint_model_config(recipe.checkpoint.load)
    if saved is not None and not getattr(saved, "dspark_layers", 0):
        raise ConfigError(f"rl.rollout.engine.speculative: the inference servers load checkpoint.load "
                          f"({recipe.checkpoint.load}), whose model has no DSpark drafter (model.dspark_layers: 0); "
                          "load a checkpoint of the DSpark stage (phase.kind: dspark) or set it false")


def check_memory(recipe: RecipeConfig, world_size: int, host: HostMemory | None) -> None:
    """Refuse a run whose per-rank memory plan exceeds what this host offers each rank (the
    most loaded rank of the plan of every pipeline stage: ``launch`` before any rank starts)."""
    if host is None or not recipe.training.memory_check:
        return
    from megatron_s2.planning.memory import estimate_memory

    _refuse_if_over(recipe, estimate_memory(recipe, world_size).peak, host)


def check_rank_memory(recipe: RecipeConfig, layout, rank: int, skeleton, host: HostMemory | None) -> None:
    """Inside a rank, before its model gets storage: this rank's plan, counted on its own model
    built on the meta device (``skeleton``, which the trainer then materialises: the model is
    constructed once per start). Every rank agrees on the outcome (the most loaded rank's plan
    decides), so a refusal ends them all with the same one line."""
    if host is None or not recipe.training.memory_check:
        return
    from megatron_s2.planning.memory import rank_memory

    mine = rank_memory(recipe, layout, rank, skeleton=skeleton)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (mine.total / host.bytes_per_rank, mine))
        mine = max(everyone, key=lambda pair: pair[0])[1]
    _refuse_if_over(recipe, mine, host)


def _refuse_if_over(recipe: RecipeConfig, peak, host: HostMemory) -> None:
    if peak.total <= host.bytes_per_rank:
        return
    t = recipe.training
    state, acts = peak.state.total / GiB, peak.activations / GiB
    if acts >= state:
        field = "training.seq_length"
        fix = (f"lower training.seq_length ({t.seq_length}) or training.micro_batch_size ({t.micro_batch_size}), "
               "split it over more ranks (parallel.tp/cp/pp) or recompute (parallel.recompute)")
    else:
        field = "parallel"
        fix = "shard the model over more ranks (parallel.tp/pp/ep, distributed_optimizer) or use a smaller model"
    resident = peak.resident_bytes / GiB
    if resident > max(state, acts):
        field = f"{recipe.phase.kind}.rollout.engine"
        fix = ("lower its max_num_seqs or max_model_len (KV pages), raise rollout_ep / rollout_engram_parallel "
               "(rollout copy and frozen models), or use share_weights: auto with a tp/ep/dp training layout")
    resident = f", {resident:.1f} GiB rollout copy, engine KV and frozen models" if peak.resident else ""
    raise ConfigError(f"{field}: a rank needs about {peak.total / GiB:.1f} GiB ({state:.1f} GiB model and optimiser "
                      f"state, {acts:.1f} GiB activations{resident}; `megatron-s2 plan memory`) but this host has "
                      f"{host.source} ({host.bytes_per_rank / GiB:.1f} GiB per rank); {fix}, or set "
                      "training.memory_check=false if the plan is wrong for this machine")


def check_backend(recipe: RecipeConfig) -> None:
    """The model family's own start-up checks (e.g. ``model.transformer_impl: transformer_engine``
    needs Transformer Engine importable where the ranks run), and ``MEGATRON_S2_KERNELS`` must
    name a mode (refused before the run directory is touched or ranks are started)."""
    from megatron_s2.kernels.dispatch import kernel_mode

    if kernel_mode() == "triton":
        import torch

        from megatron_s2.kernels.dispatch import use_triton

        if not torch.cuda.is_available():  # every tensor will be on the CPU: the same check, before the run
            use_triton(torch.empty(0))
    from megatron_s2.models.family import family_of

    family_of(recipe.model).check_recipe(recipe)


def check_weight_sync(recipe: RecipeConfig) -> None:
    """``rl.disaggregated.broadcast_backend: nccl`` moves the trainer's GPU tensors: refused where
    the ranks run without CUDA or without NCCL (it would otherwise fail at the first update and
    fall back to checkpoints at every step, silently)."""
    rl = getattr(recipe, "rl", None)
    if recipe.phase.kind != "rl" or rl is None or rl.mode != "disaggregated":
        return
    sync = rl.disaggregated
    if sync.weight_sync != "broadcast" or sync.broadcast_backend != "nccl":
        return
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available() or not (dist.is_available() and dist.is_nccl_available()):
        raise ConfigError("rl.disaggregated.broadcast_backend: nccl needs CUDA and NCCL where the trainer runs, and "
                          "this machine has none; set rl.disaggregated.broadcast_backend=gloo")


def check_drafter_phase(recipe: RecipeConfig) -> None:
    """A phase that trains the DSpark drafter (``phase.kind: dspark`` or ``phase.train_drafter``)
    needs a model with one, and a layout the drafter supports."""
    phase = recipe.phase
    section = getattr(recipe, phase.kind, None) if phase.kind in ("rl", "opd") else None
    if section is not None and section.rollout.engine.speculative and not getattr(recipe.model, "dspark_layers", 0):
        raise ConfigError(f"{phase.kind}.rollout.engine.speculative: the model has no DSpark drafter "
                          "(model.dspark_layers: 0); train one (phase.kind: dspark) or set it false")
    if not phase.trains_drafter:
        return
    what = "phase.kind: dspark" if phase.kind == "dspark" else "phase.train_drafter"
    if not getattr(recipe.model, "dspark_layers", 0):
        raise ConfigError(f"model.dspark_layers: {what} trains the DSpark drafter, but the model has none; set "
                          "model.dspark_layers (and dspark_target_layer_ids) or use another phase")
    p, seq = recipe.parallel, recipe.training.seq_length
    chunk = seq // (2 * p.cp)
    if p.cp > 1 and chunk < recipe.model.dspark_block_size:  # each chunk's last anchors read the next chunk's head
        raise ConfigError(f"parallel.cp: {what} under cp={p.cp} cuts training.seq_length {seq} into chunks of {chunk} "
                          f"tokens, shorter than model.dspark_block_size {recipe.model.dspark_block_size}; lower cp "
                          "or raise seq_length")


def check_drafter_stages(recipe: RecipeConfig, world_size: int) -> None:
    """Under pipeline parallelism the drafter lives on the last stage, beside the head (§2.4.3),
    and reads the target layers' outputs there: every ``dspark_target_layer_ids`` must fall in the
    last (virtual) stage's layers. (The first stage's embedding is replicated to it.)"""
    if not recipe.phase.trains_drafter or recipe.parallel.pp == 1 or not getattr(recipe.model, "dspark_layers", 0):
        return
    from megatron_s2.parallel.layout import ParallelLayout

    try:
        last = ParallelLayout.from_recipe(recipe, world_size).stage_layers[-1]
    except ConfigError:  # a layout that does not fit world_size: the launcher / trainer names it
        return
    away = [i for i in recipe.model.dspark_target_layer_ids if i not in last]
    if away:
        raise ConfigError(f"model.dspark_target_layer_ids: layer(s) {away} are not on the last pipeline stage "
                          f"(layers {last[0]}-{last[-1]}), where the drafter reads them; move the cut with "
                          "parallel.pipeline_layers so the last stage holds them, or lower parallel.pp")


def check_phase_layout(recipe: RecipeConfig) -> None:
    """A layout the phase cannot use is wrong at any rank count: the drafter's
    (:func:`check_drafter_phase`), and visual next-patch pre-training's — data parallelism only, its
    pages' forward runs inside the loss over whole sequences (megatron_s2/training/next_patch_trainer.py)."""
    check_drafter_phase(recipe)
    check_series_layout(recipe)
    check_memdec_layout(recipe)
    if recipe.phase.kind != "visual_next_patch":
        return
    p = recipe.parallel
    split = [f"parallel.{name}={getattr(p, name)}" for name in ("tp", "pp", "cp", "ep", "etp") if getattr(p, name) > 1]
    if split:
        raise ConfigError(f"phase.kind: visual_next_patch runs on data-parallel layouts only (the pages' forward runs "
                          f"inside the loss over whole sequences); got {', '.join(split)}: set them to 1")


def check_run_inputs(recipe: RecipeConfig, world_size: int, host: HostMemory | None,
                     run_dir: str | Path | None = None, *, ranks_here: bool = True, pending: Sequence[str | Path] = ()):
    """All start-up checks of a run (module docstring); returns the run's tokenizer.
    ``run_dir``: where the run writes (default ``training.run_dir``); ``ranks_here``: the ranks
    run on this machine (False for a SLURM submission: its compute nodes are not this host);
    ``pending``: run directories of a pipeline's earlier phases, not written yet."""
    if ranks_here:
        check_backend(recipe)
        check_weight_sync(recipe)
    run_dir = run_dir if run_dir is not None else recipe.training.run_dir
    check_run_dir(run_dir)
    check_phase_layout(recipe)
    check_drafter_stages(recipe, world_size)
    check_image_layout(recipe)
    tokenizer = check_tokenizer(recipe)
    check_data(recipe, tokenizer)
    check_checkpoint_load(recipe, run_dir, pending)
    check_memory(recipe, world_size, host)
    return tokenizer
