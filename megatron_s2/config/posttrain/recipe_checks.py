"""Cross-section rules between ``phase``, ``rl`` / ``opd`` and ``training`` of one recipe.

Called by :class:`~megatron_s2.config.recipe.RecipeConfig` at construction, so a recipe that
cannot run is refused by ``train``, ``launch`` (also ``--dry-run``) and ``plan`` alike, with one
line naming the field and the fix.
"""

from __future__ import annotations

from pathlib import Path

from megatron_s2.config.schema import ConfigError

__all__ = ["check_posttrain_recipe", "environment_key", "posttrain_section"]


def posttrain_section(recipe):
    """The ``rl`` or ``opd`` section of a post-training recipe (None for pretrain / sft)."""
    return recipe.rl if recipe.phase.kind == "rl" else recipe.opd if recipe.phase.kind == "opd" else None


def environment_key(kind: str, rollout, dataset: str) -> str:
    """The recipe key of a rollout dataset's environment (its own, or the section's default)."""
    for slot in rollout.datasets:
        if slot.name == dataset and slot.environment is not None:
            return f"{kind}.rollout.datasets.{dataset}.environment"
    return f"{kind}.rollout.environment"


def check_posttrain_recipe(recipe) -> None:
    kind = recipe.phase.kind
    for name in ("rl", "opd"):
        present = getattr(recipe, name) is not None
        if present and kind != name:
            raise ConfigError(f"{name}: the recipe has an '{name}:' section but phase.kind is '{kind}'; set "
                              f"phase.kind: {name} or remove the section")
        if not present and kind == name:
            raise ConfigError(f"{name}: phase.kind is '{name}' but the recipe has no '{name}:' section; add one "
                              f"(see recipes/{name}_tiny.yaml)")
    section = posttrain_section(recipe)
    if section is None:
        return
    rollout, t = section.rollout, recipe.training
    sizes = {rollout.group_of(n) for n in rollout.dataset_names()}
    if len(sizes) != 1:
        raise ConfigError(f"{kind}.rollout.datasets: group sizes {sorted(sizes)} differ; a training step takes "
                          "rollout.batch_groups groups of one size (training.global_batch_size samples)")
    samples = rollout.batch_groups * sizes.pop()
    if t.global_batch_size != samples:
        raise ConfigError(f"training.global_batch_size: a {kind} step trains on rollout.batch_groups x group_size = "
                          f"{samples} samples; set training.global_batch_size: {samples}")
    if section.loss.temperature != rollout.temperature:
        raise ConfigError(f"{kind}.loss.temperature: {section.loss.temperature} differs from the sampling temperature "
                          f"{kind}.rollout.temperature = {rollout.temperature}; the behaviour log-probs are taken "
                          "under the sampling distribution, so set them equal")
    if rollout.top_p != 1.0:
        raise ConfigError(f"{kind}.rollout.top_p: the trainer's log-probs are over the full vocabulary, so nucleus "
                          "sampling would bias the importance weights; set top_p: 1.0")
    engine = rollout.engine
    if engine.max_model_len and engine.max_model_len > t.seq_length + 1:
        raise ConfigError(f"{kind}.rollout.engine.max_model_len: {engine.max_model_len} tokens do not fit one training "
                          f"row of training.seq_length + 1 = {t.seq_length + 1}; lower it or raise seq_length")
    if recipe.phase.freeze:
        raise ConfigError(f"phase.freeze: {kind} phases train the whole policy; remove phase.freeze")
    if (section.eval.interval or section.eval.at_start) and not rollout.uses_verifiers:  # (verifiers: below)
        names = rollout.dataset_names()
        if all(rollout.environment_of(n).eval_prompts == 0 for n in names):
            # nothing to evaluate would be logged as accuracy 0.000 (a dataset with 0 is left out)
            keys = dict.fromkeys(f"{environment_key(kind, rollout, n)}.eval_prompts" for n in names)
            raise ConfigError(f"{', '.join(keys)}: 0 held-out prompts, but evaluation is on ({kind}.eval.interval="
                              f"{section.eval.interval}, {kind}.eval.at_start={str(section.eval.at_start).lower()}); "
                              f"set eval_prompts >= 1, or {kind}.eval.interval=0 and {kind}.eval.at_start=false")
    if rollout.uses_verifiers:
        _check_verifiers(recipe, section, kind)
    if rollout.uses_agentic:
        _check_agentic(recipe, section, kind)
    if kind == "opd" and section.sft_warmup.steps > t.train_steps:
        raise ConfigError(f"opd.sft_warmup.steps: {section.sft_warmup.steps} warm-up steps exceed training.train_steps = "
                          f"{t.train_steps} (the warm-up steps are the phase's first steps); raise train_steps or "
                          "lower sft_warmup.steps")
    warmup_data = section.sft_warmup.data if kind == "opd" and section.sft_warmup.steps else ""
    if warmup_data and not Path(warmup_data).is_file():  # at load: `launch` refuses it before starting ranks
        raise ConfigError(f"opd.sft_warmup.data: {warmup_data} is not a file; give a JSON-lines file of teacher "
                          "trajectories ({\"tokens\": [...], \"loss_mask\": [...]} per line) or data: '' to "
                          "generate them")


def _check_verifiers(recipe, section, kind: str) -> None:
    """What the verifiers rollout backend (megatron_s2/posttrain/rollout/vf_backend.py) cannot do yet."""
    rollout, ev = section.rollout, section.eval
    if ev.interval or ev.at_start:
        when = f"{kind}.eval.interval={ev.interval}, {kind}.eval.at_start={str(ev.at_start).lower()}"
        off = f"{kind}.eval.interval=0 and {kind}.eval.at_start=false"
        if kind == "opd":  # the teacher metrics play the teachers' greedy answers as token-level episodes
            raise ConfigError(f"opd.eval: the distillation metrics of held-out prompts need token-level episodes, "
                              f"which a verifiers environment does not have ({when}); set {off}")
        for name in rollout.dataset_names():
            if not rollout.environment_of(name).eval_taskset:
                raise ConfigError(f"{environment_key(kind, rollout, name)}.eval_taskset: evaluation is on ({when}) but "
                                  "the verifiers environment declares no held-out tasks; set eval_taskset (e.g. "
                                  f"{{split: eval, count: 256}} for megatron_s2_tasks), or {off}")
    warmup = getattr(section, "sft_warmup", None)
    if warmup is not None and warmup.steps and not warmup.data:
        raise ConfigError("opd.sft_warmup.data: the warm-up generates teacher trajectories with token-level episodes, "
                          "which a verifiers environment does not have; give a JSON-lines file of trajectories "
                          "(tokens + loss_mask) or set sft_warmup.steps: 0")
    effort = getattr(section, "effort", None)
    if effort is not None and effort.enabled:
        raise ConfigError(f"{kind}.effort.levels: effort-conditioned prompts cannot be injected into a verifiers "
                          "taskset's prompts; set levels: []")
    if recipe.data.tokenizer == "char":
        raise ConfigError("data.tokenizer: a verifiers environment renders chats with a Hugging Face tokenizer "
                          "(renderers); set data.tokenizer to a tokenizer directory, e.g. recipes/tokenizers/tiny-bpe")


def _check_agentic(recipe, section, kind: str) -> None:
    """What the agentic rollout back end (megatron_s2/posttrain/rollout/agentic_backend.py) cannot do yet."""
    if kind == "opd":
        raise ConfigError("opd.rollout.environment.kind: agentic environments are trained by rl phases only so far "
                          "(the distillation signal of a harness episode is not wired); use phase.kind: rl")
    advantage = getattr(section, "advantage", None)
    if advantage is not None and advantage.credit == "turn":
        raise ConfigError(f"{kind}.advantage.credit: turn needs a reward per assistant turn, and a harness episode has "
                          "one (the grade after the agent stopped), credited per session over every trace branch; "
                          "use credit: session")
    effort = getattr(section, "effort", None)
    if effort is not None and effort.enabled:
        raise ConfigError(f"{kind}.effort.levels: effort-conditioned prompts cannot be injected into a harness's own "
                          "prompts; set levels: []")
    if recipe.data.tokenizer == "char":
        raise ConfigError("data.tokenizer: the agent gateway renders the harnesses' chats with the tokenizer's chat "
                          "template, which the character tokenizer has not; set data.tokenizer to a tokenizer "
                          "directory, e.g. recipes/tokenizers/tiny-bpe")
