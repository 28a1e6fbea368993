"""Checks of a post-training recipe that need more than the recipe: the post-training code, the
model family, the file system or the tokenizer.

The ``rl:`` / ``opd:`` sections are plain dataclasses (:mod:`megatron_s2.config.posttrain`), so
loading a recipe never imports torch and validates values only. :func:`check_posttrain_inputs`
does the rest, before any rank starts (``megatron-s2 launch``: every phase of a pipeline before
the first starts) and again in :class:`~megatron_s2.posttrain.trainer.PosttrainTrainer` before the
model is built (``megatron-s2 train``):

1. registry names — group estimators, advantage transforms, loss terms, token masks — exist
   (a plugin may extend the registries);
2. the rollout engine's settings are ones the model family's executor can honour (e.g. KV pages
   of V4.1 hold whole compressed blocks);
3. the frozen models' checkpoints (``rl.reference_checkpoint``, ``opd.teachers[i].checkpoint``)
   exist and hold a checkpoint — or lie in the run directory of an earlier phase of the pipeline;
4. every prompt of the embedded-task environments fits the engine's ``max_model_len`` with room
   to generate;
5. every verifiers environment builds from its ``taskset`` / ``eval_taskset`` (the plugin's own
   validation: unknown fields, types, ranges, ids), and its held-out tasks are not all training
   tasks (the launch pre-flight builds them);
6. every agentic environment's tasks exist and its held-out instances do (launch pre-flight: the
   trainer builds the environment, which draws them);
7. (trainer only: it needs the drawn prompt sets) evaluation has held-out prompts to play.

Each refusal is one :class:`ConfigError` line naming the recipe key and the fix (exit code 2).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from megatron_s2.config.posttrain.engines import engine_configs, engine_max_model_len
from megatron_s2.config.posttrain.recipe_checks import environment_key, posttrain_section
from megatron_s2.config.schema import ConfigError

__all__ = ["check_registered_names", "check_posttrain_inputs", "check_engine_settings", "check_frozen_checkpoints",
           "check_prompts", "check_verifiers_tasksets", "check_agentic_tasks", "check_held_out_prompts"]


def _known(path: str, name: str, registry: dict, what: str) -> None:
    if name not in registry:
        raise ConfigError(f"{path}: '{name}' is not a registered {what}; use one of {', '.join(sorted(registry))}")


def check_registered_names(recipe) -> None:
    """Every registry name of the recipe's ``rl`` / ``opd`` section exists (no-op for other phases)."""
    section = posttrain_section(recipe)
    if section is None:
        return
    from megatron_s2.posttrain.advantages import ADVANTAGE_TRANSFORMS, GROUP_ESTIMATORS
    from megatron_s2.posttrain.losses import LOSS_TERMS, TOKEN_MASKS

    kind = recipe.phase.kind
    advantage = getattr(section, "advantage", None)
    if advantage is not None:
        _known(f"{kind}.advantage.estimator", advantage.estimator, GROUP_ESTIMATORS, "group estimator")
        for name in advantage.transforms:
            _known(f"{kind}.advantage.transforms", name, ADVANTAGE_TRANSFORMS, "advantage transform")
    for i, term in enumerate(section.loss.terms):
        _known(f"{kind}.loss.terms[{i}].kind", term.kind, LOSS_TERMS, "loss term")
    for name in section.loss.masks:
        _known(f"{kind}.loss.masks", name, TOKEN_MASKS, "token mask")


def check_engine_settings(recipe) -> None:
    """The rollout engine's configuration is one the model family can run (its executor's rules)."""
    from megatron_s2.models.family import family_of

    section, kind = posttrain_section(recipe), recipe.phase.kind
    try:
        # rollout and eval engines differ only in their queue bound; the family judges the rest
        family_of(recipe.model).check_engine(recipe.model, engine_configs(recipe, section.rollout)["rollout"])
    except ConfigError as exc:  # the engine's field names are those of rollout.engine
        raise ConfigError(f"{kind}.rollout.engine.{exc}") from None


def check_frozen_checkpoints(recipe, pending: Sequence[str] = ()) -> None:
    """The reference (a ``reference_kl`` term) and the in-process teachers name loadable
    checkpoints, unless they lie in ``pending`` (earlier phases' run directories)."""
    from megatron_s2.checkpoint.locate import checkpoint_problem, may_be_created

    section, kind = posttrain_section(recipe), recipe.phase.kind

    def refuse_unloadable(key: str, path: str, what: str) -> None:
        if may_be_created(path, pending):
            return
        problem = checkpoint_problem(path, hf_export=True)
        if problem:
            raise ConfigError(f"{key}: {problem} ({what}); give a run, checkpoints, step or Hugging Face directory")

    if section.loss.has_term("reference_kl"):
        own = getattr(section, "reference_checkpoint", "")  # opd: the initial weights only
        if own:
            refuse_unloadable(f"{kind}.reference_checkpoint", own, "the frozen reference of the reference_kl term")
        elif recipe.checkpoint.load:  # read as the reference even when the run resumes
            refuse_unloadable("checkpoint.load", recipe.checkpoint.load, "also the reference of the reference_kl term")
        elif kind == "rl":
            raise ConfigError("rl.reference_checkpoint: the reference_kl term needs a frozen reference; set it, or "
                              "checkpoint.load (the reference is then the weights this phase starts from)")
        else:
            raise ConfigError(f"checkpoint.load: the reference_kl term of {kind}.loss.terms needs a frozen reference, "
                              "the weights this phase starts from; set checkpoint.load or drop the term")
    for i, teacher in enumerate(getattr(section, "teachers", ())):
        if teacher.checkpoint:
            refuse_unloadable(f"opd.teachers[{i}].checkpoint", teacher.checkpoint, f"teacher '{teacher.name}'")


def check_prompts(recipe, tokenizer, environments: Mapping | None = None) -> None:
    """Every first-turn prompt of the environments (at every effort level; verifiers environments
    render theirs only while rolling out) leaves room to generate within the engine's
    ``max_model_len``. ``environments``: the trainer's, by dataset name; without them (launch
    pre-flight) an environment's prompt sets are drawn only when the task's bound on its longest
    prompt (:meth:`~megatron_s2.posttrain.envs.TaskEnvironment.prompt_tokens_at_most`) does not
    already settle it."""
    from megatron_s2.posttrain.envs import ENVIRONMENTS, build_environment

    section, kind = posttrain_section(recipe), recipe.phase.kind
    rollout = section.rollout
    effort = getattr(section, "effort", None)
    levels = effort.levels if effort is not None and effort.enabled else (None,)
    splits = ("train", "eval") if section.eval.interval or section.eval.at_start else ("train",)
    limit = engine_max_model_len(recipe, rollout)
    for name in rollout.dataset_names():
        config, key = rollout.environment_of(name), environment_key(kind, rollout, name)
        if config.kind == "verifiers" or (config.kind == "agentic" and environments is None):
            continue  # (agentic: the trainer checks the built environment's opening chat)
        env = (environments or {}).get(name)
        if env is None:
            bound = getattr(ENVIRONMENTS[config.kind], "prompt_tokens_at_most", None)
            if bound is not None and bound(config, tokenizer, levels) < limit:
                continue  # every prompt fits: no need to draw them here
            env = build_environment(name, config, tokenizer, what=key)
        for split in splits:
            longest = env.longest_prompt_from(limit, split, levels)
            if longest:  # the engine would refuse it (PromptTooLong) in the middle of a step
                raise ConfigError(_too_long(recipe, kind, key, longest, limit))


def check_verifiers_tasksets(recipe, environments: Mapping | None = None) -> None:
    """Every verifiers environment builds — its ``taskset`` and ``eval_taskset`` are configs its
    plugin accepts (known fields, values of the right type and range, an id that imports) — and,
    with evaluation on, its held-out tasks are not all training tasks. ``environments``: the
    trainer's; without them (launch pre-flight) each verifiers environment is built here, so a
    careless ``eval_taskset`` is refused before any rank starts, not by the rank."""
    section, kind = posttrain_section(recipe), recipe.phase.kind
    rollout = section.rollout
    evaluating = bool(section.eval.interval or section.eval.at_start)
    for name in rollout.dataset_names():
        config, key = rollout.environment_of(name), environment_key(kind, rollout, name)
        if config.kind != "verifiers":
            continue
        env = (environments or {}).get(name)
        if env is None:
            from megatron_s2.posttrain.envs import build_environment

            env = build_environment(name, config, None, what=key)  # its tasks need no tokenizer
        if evaluating and config.eval_taskset and not env.size("eval"):
            raise ConfigError(_no_held_out_tasks(kind, [key]))


def check_agentic_tasks(recipe, environments: Mapping | None = None) -> None:
    """Every agentic environment's ``tasks`` are known and ``eval_prompts`` distinct held-out
    instances exist — checked in the launch pre-flight (``environments`` None) by drawing them,
    without the sandbox probe the environment's build makes (a login node may lack bubblewrap)."""
    if environments is not None:
        return  # the trainer's environments drew them when built
    section, kind = posttrain_section(recipe), recipe.phase.kind
    rollout = section.rollout
    for name in rollout.dataset_names():
        config = rollout.environment_of(name)
        if config.kind == "agentic":
            from megatron_s2.posttrain.envs.agentic_env import draw_instances

            draw_instances(config, environment_key(kind, rollout, name))


def _no_held_out_tasks(kind: str, environment_keys: Sequence[str]) -> str:
    keys = ", ".join(dict.fromkeys(f"{key}.eval_taskset" for key in environment_keys))
    return (f"{keys}: every held-out task's opening chat is also a training task's, so evaluation "
            "would have nothing to play; select tasks the training taskset does not hold (e.g. split: eval), or "
            f"set {kind}.eval.interval=0 and {kind}.eval.at_start=false")


def check_held_out_prompts(recipe, environments: Mapping) -> None:
    """With evaluation on, some environment has held-out prompts left once those that also occur
    among its training prompts are dropped (a small task space, or a verifiers ``eval_taskset``
    that selects training tasks, can leave none: every evaluation would log accuracy 0.000).
    Needs the drawn prompt sets: run by the trainer, which has them."""
    section, kind = posttrain_section(recipe), recipe.phase.kind
    rollout = section.rollout
    if not (section.eval.interval or section.eval.at_start):
        return
    names = rollout.dataset_names()
    if any(environments[n].size("eval") for n in names):
        return
    off = f"{kind}.eval.interval=0 and {kind}.eval.at_start=false"
    if rollout.uses_verifiers:  # its held-out tasks exist (checked at build), all among the training tasks
        raise ConfigError(_no_held_out_tasks(kind, [environment_key(kind, rollout, n) for n in names]))
    keys = dict.fromkeys(f"{environment_key(kind, rollout, n)}.eval_prompts" for n in names)
    raise ConfigError(f"{', '.join(keys)}: every held-out prompt also occurs among the training prompts (the "
                      "task has too few distinct prompts), so evaluation would have nothing to play; lower "
                      f"num_prompts, make the task harder, or set {off}")


def _too_long(recipe, kind: str, env_key: str, longest: int, limit: int) -> str:
    """The refusal of a prompt of ``longest`` tokens that leaves nothing to generate within ``limit``."""
    rollout = posttrain_section(recipe).rollout
    need = longest + rollout.max_new_tokens  # the prompt and a full response
    if rollout.engine.max_model_len:
        return (f"{kind}.rollout.engine.max_model_len: the longest prompt of {env_key} has {longest} tokens, which "
                f"leaves no room to generate within {limit}; raise it to {need} (prompt + {kind}.rollout."
                f"max_new_tokens), with training.seq_length >= {need - 1}")
    return (f"training.seq_length: the longest prompt of {env_key} has {longest} tokens, which leaves no room to "
            f"generate within the engine's max_model_len = seq_length + 1 = {limit}; raise training.seq_length to "
            f"at least {need - 1} (prompt + {kind}.rollout.max_new_tokens = {need} tokens)")


def check_posttrain_inputs(recipe, tokenizer, *, pending: Sequence[str] = (), environments: Mapping | None = None
                           ) -> None:
    """Every check of the module docstring, in order (no-op for pretrain / sft phases).
    ``tokenizer``: the run's (from :func:`~megatron_s2.training.run_checks.check_run_inputs`);
    ``pending``: run directories of a pipeline's earlier phases; ``environments``: the trainer's
    (by dataset name), None in the launch pre-flight."""
    if posttrain_section(recipe) is None:
        return
    check_registered_names(recipe)
    check_engine_settings(recipe)
    check_frozen_checkpoints(recipe, pending)
    check_prompts(recipe, tokenizer, environments)
    check_verifiers_tasksets(recipe, environments)
    check_agentic_tasks(recipe, environments)
    if environments is not None:
        check_held_out_prompts(recipe, environments)
