"""``rollout.environment`` and ``rollout.engine``: what the policy is rolled out on, and with what.

:class:`EnvironmentConfig` names a registered environment (:data:`megatron_s2.posttrain.envs.ENVIRONMENTS`):

* ``task`` — one of the embedded verifiable tasks (``megatron_s2/data/tasks.py``) as a
  single-turn environment: the prompt is rendered exactly like SFT data (``bos prompt sep``),
  the response is the tokens up to ``eos`` and the reward is the task's exact verifier;
* ``task_retry`` — the same task as a multi-turn environment: after a wrong answer the
  environment replies (loss-masked tokens) and the policy answers again, up to ``max_turns``;
  the whole session is one training sample;
* ``verifiers`` — any verifiers v1 environment (taskset x harness), rolled out through our
  OpenAI-compatible server over the co-located engine exactly as verifiers reaches any model
  (:mod:`megatron_s2.posttrain.rollout.vf_backend`);
* ``agentic`` — the embedded agentic tasks (``megatron_s2/posttrain/agentic/tasks``), each episode a
  real harness (``agent.harness``) playing a seeded task instance in a sandbox against the in-process
  agent gateway over the co-located engine, its PrefixTree trace trained token-in/token-out with the
  process weights of Eq. 30 (:mod:`megatron_s2.posttrain.rollout.agentic_backend`).
(The same tasks as a ``verifiers`` v1 taskset + harness for any verifiers trainer, over
``megatron-s2 serve``: :mod:`megatron_s2.posttrain.envs.vf_tasks`.)

:class:`RolloutEngineConfig` sizes the co-located inference engine (report §5.2.1) and holds the
routing-replay (R3, §5.2.1) and bounded-replay (§3.2.2) switches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_s2.config.data import TASK_NAMES, TaskDifficulty
from megatron_s2.config.posttrain.agentic import ProcessAnnotatorConfig, SandboxConfig, check_agent
from megatron_s2.config.schema import ConfigError

__all__ = ["EnvironmentConfig", "RolloutEngineConfig", "EvaluationConfig"]


@dataclass(frozen=True)
class EnvironmentConfig:
    """Where a dataset's prompts come from and how responses are scored."""

    kind: Literal["task", "task_retry", "verifiers", "agentic"] = "task"
    """'task': single-turn embedded task; 'task_retry': multi-turn (retry after feedback);
    'verifiers': a verifiers (v1) environment — ``taskset`` x ``harness`` — whose rollouts reach
    the co-located engine through our OpenAI-compatible server (:mod:`..rollout.vf_backend`);
    'agentic': harness episodes on the embedded agentic tasks through the in-process agent gateway
    (:mod:`..rollout.agentic_backend`)."""
    task: str = "addition"
    """Embedded task name (any of megatron_s2.config.data.TASK_NAMES)."""
    difficulty: TaskDifficulty = field(default_factory=TaskDifficulty)
    """Difficulty knobs of the task (set them as in the SFT phase that preceded this one)."""
    num_prompts: int = 4096
    """Training prompts, generated deterministically from ``seed`` (read in per-epoch shuffles)."""
    eval_prompts: int = 256
    """Held-out prompts for evaluation, generated from a different stream (never trained on)."""
    seed: int = 0
    """Seed of prompt generation (independent of the run seed, so runs with different seeds see
    the same prompts)."""
    max_turns: int = 1
    """task_retry: attempts per session (>= 2 makes it multi-turn); agentic: the harness's model
    calls per episode (its turn budget; an episode cut by it ends 'turn_limit')."""
    feedback: str = " wrong, again:"
    """task_retry: the environment's reply after a wrong answer (tokenised, loss-masked)."""
    taskset: dict[str, Any] = field(default_factory=dict)
    """verifiers: the taskset config, ``{id: <plugin id>, <that taskset's config fields>}`` (e.g.
    ``{id: megatron_s2_tasks, task_name: addition, split: train, count: 4000}``); its tasks are
    the prompts, its ``@vf.reward`` functions the rubric."""
    eval_taskset: dict[str, Any] = field(default_factory=dict)
    """verifiers: the held-out tasks played by ``eval`` (a verifiers taskset has no split of its
    own): the fields that differ from ``taskset`` — e.g. ``{split: eval, count: 256}``, the embedded
    tasks' held-out prompts — or a whole taskset config with another ``id``. Tasks whose opening
    chat is also a training task's are dropped (held-out = never trained on). Needed when
    evaluation is on; {} = none."""
    agent: dict[str, Any] = field(default_factory=dict)
    """verifiers: the agent (``vf.AgentConfig``): ``harness: {id: <plugin id>, ...}`` (default: the
    taskset's harness), ``runtime`` (default ``{type: subprocess}``: on this host), ``max_turns`` ...
    agentic: ``{harness: builtin | openai_agents | anthropic | smolagents}`` (default builtin;
    ``api: chat | responses`` for openai_agents)."""
    tasks: tuple[str, ...] = ()
    """agentic: the embedded agentic tasks played (``python -m megatron_s2.posttrain.agentic list``);
    ``sum_pair`` / ``copy_word`` / ``spot_seven`` get a seeded instance per prompt (``num_prompts`` training
    instances, ``eval_prompts`` distinct held-out ones, split by content: never trained on)."""
    max_operand: int = 99
    """agentic: the largest operand of ``sum_pair`` instances (9 = one-digit sums, the easiest)."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """agentic: each episode's sandbox (isolation backend and limits)."""
    process_annotator: ProcessAnnotatorConfig = field(default_factory=ProcessAnnotatorConfig)
    """agentic: process weights of the policy segments (Eq. 30)."""
    plugin_path: str = ""
    """verifiers: a folder put on ``sys.path`` so the taskset / harness ids import (relative paths:
    working directory, then the project root); '' = installed packages only. The embedded tasks
    (id ``megatron_s2_tasks``) are always importable."""
    max_concurrent: int = 0
    """verifiers, agentic: episodes run at once on a rollout replica; 0 = rollout.max_in_flight."""
    renderer: Literal["bridge", "default"] = "bridge"
    """verifiers: how the training client renders chats to token ids with the run's tokenizer:
    'default' = renderers' DefaultRenderer (the chat template, every call re-rendered from the
    messages); 'bridge' = the same plus turn bridging (the next call's prompt extends the ids
    the engine generated verbatim, so a multi-turn session stays one training sample;
    megatron_s2/posttrain/envs/vf_renderer.py)."""

    def __post_init__(self) -> None:
        if self.task not in TASK_NAMES:
            raise ConfigError(f"task: unknown task '{self.task}'; valid names: {', '.join(TASK_NAMES)}")
        if self.num_prompts < 1:
            raise ConfigError(f"num_prompts: must be >= 1, got {self.num_prompts}")
        if self.eval_prompts < 0:
            raise ConfigError(f"eval_prompts: must be >= 0, got {self.eval_prompts}")
        if self.max_turns < 1:
            raise ConfigError(f"max_turns: must be >= 1, got {self.max_turns}")
        if self.kind == "task_retry" and self.max_turns < 2:
            raise ConfigError("max_turns: a task_retry environment needs at least 2 turns; set max_turns: 2 "
                              "or use kind: task")
        if self.kind not in ("task_retry", "agentic") and self.max_turns != 1:
            raise ConfigError(f"max_turns: only kinds 'task_retry' and 'agentic' have several turns; set kind: "
                              f"task_retry or max_turns: 1 (kind is '{self.kind}')")
        if self.kind == "verifiers" and not self.taskset.get("id"):
            raise ConfigError("taskset: a verifiers environment needs the taskset's plugin id; set taskset: {id: "
                              "<id>, ...} (e.g. megatron_s2_tasks)")
        if self.kind != "verifiers" and (self.taskset or self.eval_taskset or self.plugin_path):
            raise ConfigError(f"taskset: taskset / eval_taskset / plugin_path configure a verifiers "
                              f"environment; set kind: verifiers or remove them (kind is '{self.kind}')")
        if self.kind not in ("verifiers", "agentic") and self.agent:
            raise ConfigError(f"agent: it configures the harness of a verifiers or agentic environment; set kind: "
                              f"agentic (or verifiers) or remove it (kind is '{self.kind}')")
        if self.kind == "agentic":
            if not self.tasks:
                raise ConfigError("tasks: an agentic environment needs its tasks, e.g. tasks: [copy_word] (python -m "
                                  "megatron_s2.posttrain.agentic list names them)")
            check_agent(self.agent, "agent")
            if self.max_operand < 1:
                raise ConfigError(f"max_operand: must be >= 1, got {self.max_operand}")
        elif self.tasks:
            raise ConfigError(f"tasks: it lists the tasks of an agentic environment; set kind: agentic or remove it "
                              f"(kind is '{self.kind}')")
        if self.eval_taskset and self.held_out_taskset() == dict(self.taskset):
            raise ConfigError("eval_taskset: it names the training taskset itself, so nothing would be held out; give "
                              "the fields that select held-out tasks (e.g. {split: eval, count: 256} for "
                              "megatron_s2_tasks) or another taskset id")
        if self.max_concurrent < 0:
            raise ConfigError(f"max_concurrent: must be >= 0 (0 = rollout.max_in_flight), got {self.max_concurrent}")
        for cap in ("max_turns", "max_input_tokens", "max_output_tokens", "max_total_tokens"):  # verifiers' limits
            value = self.agent.get(cap) if isinstance(self.agent, dict) else None
            if value is not None and (type(value) is not int or value < 1):
                raise ConfigError(f"agent.{cap}: must be an integer >= 1, got {value!r} (a cap below 1 refuses the "
                                  "agent's first model turn, so no trace has anything to train); raise it or remove it")
        if not 0 <= self.seed < 2 ** 63:
            raise ConfigError(f"seed: must be a non-negative integer below 2**63, got {self.seed}")

    @property
    def multi_turn(self) -> bool:
        return self.max_turns > 1

    def held_out_taskset(self) -> dict[str, Any]:
        """The verifiers taskset config of the held-out tasks: ``eval_taskset`` over ``taskset``
        (the same plugin), or ``eval_taskset`` alone when it names another id; {} = none."""
        if not self.eval_taskset:
            return {}
        if self.eval_taskset.get("id", self.taskset.get("id")) != self.taskset.get("id"):
            return dict(self.eval_taskset)
        return {**self.taskset, **self.eval_taskset}


@dataclass(frozen=True)
class RolloutEngineConfig:
    """The inference engine co-located with training (report §5.2.1): one per rollout replica."""

    max_num_seqs: int = 64
    """Sequences decoded concurrently per rollout replica (continuous batching)."""
    max_model_len: int = 0
    """Prompt + generated tokens of one request; 0 = training.seq_length + 1 (a sample must fit
    one training row)."""
    prefill_chunk: int = 256
    """Prompt tokens per request and step (chunked prefill)."""
    page_tokens: int = 16
    """Tokens per global-KV page (a multiple of every compression ratio)."""
    routing_replay: bool = True
    """Rollout Routing Replay (R3, report §5.2.1): record each token's routed experts while
    generating (concatenated across policy versions) and replay them in the training forward."""
    decoder_bounded_replay: bool = False
    """Prefill with the engine's Decoder SWA Bounded Replay (report §3.2.2): the decoder runs only
    over the last window_size prompt tokens."""
    train_aware_replay: bool = False
    """Simulate the decoder bounded replay in the training forward (a decoder query at i attends
    SWA keys in [max(s, i-W+1), i], s = the replay start), so sampled and trained distributions
    agree; needs decoder_bounded_replay, single-turn environments and resume_in_flight: discard."""
    rollout_ep: int = 1
    """Expert parallelism of a separate rollout model (built when the training layout has pp, cp or
    sequence parallelism); its tensor parallelism is the training tp."""
    rollout_engram_parallel: int = 0
    """Engram-parallel size of a separate rollout model and of the frozen models (teachers,
    reference) built on its layout: Engram table rows partitioned over this many ranks (§3.1.3);
    0 = the training ``parallel.engram_parallel``. Engram tables dominate the flagship's weights,
    so an unpartitioned copy does not fit a GPU (``megatron-s2 plan memory`` counts it)."""
    speculative: bool = False
    """Rollouts speculate with the model's DSpark drafter (V4.1 report §2.4.3; lossless, so the
    samples follow the policy exactly and carry its log-probs); ``phase.train_drafter`` keeps the
    drafter fitted to the changing policy (walkthrough Ch. 4)."""
    share_weights: Literal["auto", "never"] = "auto"
    """'auto': when the training layout is TP/EP/DP only, the engine runs the training model itself
    (no copy); 'never': always build a rollout model and transfer weights after each update."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "prefill_chunk", "page_tokens", "rollout_ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_model_len < 0:
            raise ConfigError(f"max_model_len: must be >= 0 (0 = training.seq_length + 1), got {self.max_model_len}")
        if self.rollout_engram_parallel < 0:
            raise ConfigError(f"rollout_engram_parallel: must be >= 0 (0 = parallel.engram_parallel), got "
                              f"{self.rollout_engram_parallel}")
        if self.train_aware_replay and not self.decoder_bounded_replay:
            raise ConfigError("train_aware_replay: it simulates the engine's decoder bounded replay; set "
                              "decoder_bounded_replay: true as well")


@dataclass(frozen=True)
class EvaluationConfig:
    """Held-out evaluation with the rollout engine (greedy by default), logged as eval_* metrics."""

    interval: int = 0
    """Evaluate every this many optimiser steps (and before the first and after the last); 0 = off."""
    num_prompts: int = 0
    """Held-out prompts per evaluation (the first ones of each dataset's held-out set); 0 = all."""
    temperature: float = 0.0
    """Sampling temperature of evaluation (0 = greedy)."""
    samples_per_prompt: int = 1
    """Episodes per held-out prompt (each its own seed); accuracy and reward are their mean
    (avg@k): the policy's own accuracy at ``temperature``, with k times the samples. Needs a
    temperature > 0 when > 1 (greedy episodes are identical)."""
    at_start: bool = True
    """Also evaluate before the first update (the 'before' of a before/after comparison)."""
    also_greedy: bool = False
    """With ``temperature`` > 0: also play one greedy episode per held-out prompt and report its
    accuracy as ``eval_greedy_accuracy`` (the sampled accuracy stays ``eval_accuracy``)."""

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ConfigError(f"interval: must be >= 0 (evaluate every this many steps and after the last; 0 = no "
                              f"periodic evaluation), got {self.interval}")
        if self.num_prompts < 0:
            raise ConfigError(f"num_prompts: must be >= 0 (0 = every held-out prompt), got {self.num_prompts}")
        if not self.temperature >= 0:
            raise ConfigError(f"temperature: must be >= 0, got {self.temperature}")
        if self.samples_per_prompt < 1:
            raise ConfigError(f"samples_per_prompt: must be >= 1, got {self.samples_per_prompt}")
        if self.also_greedy and self.temperature == 0:
            raise ConfigError("also_greedy: the evaluation is already greedy (temperature: 0); set temperature > 0 "
                              "(e.g. the rollout temperature) or remove also_greedy")
        if self.samples_per_prompt > 1 and self.temperature == 0:
            raise ConfigError(f"samples_per_prompt: {self.samples_per_prompt} greedy episodes of a prompt are "
                              "identical; set eval.temperature > 0 (e.g. the rollout temperature) or samples_per_prompt: 1")
