"""Held-out evaluation with the co-located engine: verifiable accuracy, and for OPD how close the
student is to its teacher.

The held-out prompts of every environment (never trained on, :mod:`~megatron_s2.posttrain.envs`)
are divided over the rollout replicas and played as full episodes (multi-turn included) on a
second engine over the policy's current weights (greedy unless ``eval.temperature`` > 0;
``eval.samples_per_prompt`` episodes per prompt give avg@k, seeded by position so that two
evaluations draw the same random numbers); the replicas' counts are all-gathered. Metrics
(``eval_*``): accuracy, mean reward, response length, truncation rate — per dataset when there
are several — and the policy version evaluated. A disaggregated run plays the same episodes on
its inference servers (:mod:`megatron_s2.posttrain.disaggregated.served_eval`). With teachers (OPD):

* ``eval_student_logprob_teacher`` — the student's mean log-probability per token of the
  teacher's greedy answers to the held-out prompts (a held-out log-likelihood that rises as the
  student moves toward the teacher; the teacher's own value is ``eval_teacher_logprob_teacher``);
* ``eval_kl_to_teacher`` — the full-vocabulary reverse KL(student || teacher) per token along the
  student's own held-out responses (report §5.2.4's objective, measured off-policy of training).

The three are the same whether a domain's teacher is in process or served (an endpoint, through
the training path's client, :class:`~megatron_s2.posttrain.opd.remote_teacher.RemoteTeacher`):
a served teacher's greedy answers are its server's completions at temperature 0 (the same
episode loop, :meth:`Evaluator.play`, on an
:class:`~megatron_s2.posttrain.opd.remote_teacher.EndpointEngine`), its log-probs of them its
``prompt_logprobs``, and the KL reads its full distribution (``prompt_logprobs`` with k = the
vocabulary size; the trainer checks at start-up that the server returns it). Only a replica's
first rank asks the server; the answers reach the replica's other ranks with the all-gather of
the results, the distributions by broadcast (:func:`once_per_replica`).

Verifiers environments (:class:`VerifiersEvaluator`) have no token-level episodes: their held-out
tasks (``environment.eval_taskset``) are played by the rollout backend through the run's own
server, the same way as training episodes, and give the same ``eval_*`` metrics, plus the rubric's
own per-episode ``@vf.metric`` values averaged over the datasets' episodes: ``eval_metric_<name>``
(sampled) and ``eval_greedy_metric_<name>`` (e.g. the retry taskset's ``first_try_correct``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from megatron_s2.inference import EngineConfig, EngineDriver, InferenceEngine, SamplingParams
from megatron_s2.posttrain.envs.base import Environment, PromptSet
from megatron_s2.posttrain.frozen import full_logits
from megatron_s2.posttrain.opd.remote_teacher import RemoteTeacher, once_per_replica
from megatron_s2.posttrain.rollout.replicas import ReplicaTopology, gather_objects
from megatron_s2.posttrain.vocab_parallel import token_log_probs, vocab_parallel_kl

__all__ = ["Evaluator", "VerifiersEvaluator", "EvalItem", "episode_seed"]

_COLUMNS = 9  # of a dataset's row of counts in Evaluator.run


@dataclass
class EvalItem:
    dataset: str
    index: int
    prompt: list[int]
    response: list[int]
    """The first call's completion (single-turn: the whole response)."""
    correct: bool | None
    """Whether the final answer verified (None: the environment gives no verdict)."""
    reward: float
    generated: int
    truncated: bool
    metrics: Mapping[str, float] = field(default_factory=dict)
    """The environment's per-episode metrics (a verifiers rubric's ``@vf.metric`` values)."""


def episode_seed(key: int, turn: int = 0) -> int:
    """The sampling seed of held-out episode ``key``'s model call ``turn``: fixed by position, so
    that two evaluations draw the same random numbers."""
    return 1_000_003 * key + turn


class Evaluator:
    def __init__(self, engine: InferenceEngine, environments: Mapping[str, Environment], topology: ReplicaTopology,
                 config, max_new_tokens: int, max_model_len: int):
        self.engine, self.envs, self.topology, self.config = engine, dict(environments), topology, config
        self.max_new_tokens, self.max_model_len = max_new_tokens, max_model_len
        self._teacher_answers: dict[tuple[str, int], list[int]] | None = None

    def items(self) -> list[tuple[str, int]]:
        out = []
        for name, env in self.envs.items():
            n = env.size("eval")
            if self.config.num_prompts:
                n = min(n, self.config.num_prompts)
            out += [(name, i) for i in range(n)]
        return out

    def mine(self) -> list[tuple[str, int]]:
        return [it for k, it in enumerate(self.items()) if self.topology.owns(k)]

    def episodes(self) -> list[tuple[str, int]]:
        """This replica's held-out episodes: each of its prompts ``samples_per_prompt`` times
        (consecutive, so every episode has its own key and seed)."""
        k = self.config.samples_per_prompt
        return [it for it in self.mine() for _ in range(k)]

    # ---- episodes -------------------------------------------------------------------------------
    def play(self, engine: InferenceEngine, items: Sequence[tuple[str, int]], temperature: float) -> list[EvalItem]:
        """Full episodes of ``items`` on ``engine`` (stepped on this thread)."""
        sessions: dict[str, dict] = {}
        results: dict[int, EvalItem] = {}

        def call(key: int, context: list[int], turn: int) -> None:
            room = self.max_model_len - len(context)
            params = SamplingParams(max_tokens=max(1, min(self.max_new_tokens, room)), temperature=temperature,
                                    seed=episode_seed(key, turn))
            rid = f"eval-{key}-{turn}"
            sessions[rid] = {"key": key, "context": context, "turn": turn}
            engine.add_request(context, params, request_id=rid, on_output=on_output)

        outputs: dict[str, list[int]] = {}
        finished: list[tuple[str, str]] = []

        def on_output(out) -> None:
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                finished.append((out.request_id, out.finish_reason.value))

        episodes = {}
        for key, (name, index) in enumerate(items):
            episodes[key] = (name, index, self.envs[name].episode(index, "eval"))
            call(key, episodes[key][2].prompt_tokens(), 0)
        first_ids: dict[int, list[int]] = {}
        generated: dict[int, int] = {}
        driver = EngineDriver(engine)
        while engine.has_work():
            driver.step()
            done, finished[:] = list(finished), []
            for rid, reason in done:
                s = sessions.pop(rid)
                key, ids = s["key"], outputs.pop(rid, [])
                name, index, episode = episodes[key]
                first_ids.setdefault(key, ids)
                generated[key] = generated.get(key, 0) + len(ids)
                step = episode.step(ids, reason)
                context = s["context"] + ids + step.delta
                if not step.done and len(context) + 1 < self.max_model_len:
                    call(key, context, s["turn"] + 1)
                    continue
                results[key] = EvalItem(name, index, episode.prompt_tokens(), first_ids[key], bool(step.correct),
                                        float(step.reward or 0.0), generated[key], reason == "length")
        return [results[k] for k in sorted(results)]

    # ---- metrics ------------------------------------------------------------------------------------
    def run(self, step: int, teacher=None, scorer_groups=None) -> dict[str, float]:
        """Evaluate the engine's current weights; collective over the world."""
        items = self.play(self.engine, self.episodes(), self.config.temperature)
        greedy = self.config.also_greedy and self.config.temperature > 0
        # per dataset: episodes, correct, reward, generated, truncated, greedy episodes, greedy
        # correct, judged (episodes with a verdict), greedy judged
        local: dict[str, list[float]] = {}
        metrics: dict[str, list[float]] = {}  # eval_metric_<name> / eval_greedy_metric_<name>: [total, count]
        for it in items:
            row = local.setdefault(it.dataset, [0.0] * _COLUMNS)
            row[0] += 1
            row[1] += float(bool(it.correct))
            row[2] += it.reward
            row[3] += it.generated
            row[4] += float(it.truncated)
            row[7] += float(it.correct is not None)
            _add_metrics(metrics, "metric_", it.metrics)
        if greedy:  # one greedy episode per prompt besides the sampled ones
            for it in self.play(self.engine, self.mine(), 0.0):
                row = local.setdefault(it.dataset, [0.0] * _COLUMNS)
                row[5] += 1
                row[6] += float(bool(it.correct))
                row[8] += float(it.correct is not None)
                _add_metrics(metrics, "greedy_metric_", it.metrics)
        extra: dict[str, list[float]] = metrics  # means over the episodes that report them, like the teacher's
        if teacher is not None:
            extra.update(self._teacher_metrics(items, *teacher, scorer_groups))
        gathered = gather_objects({"rows": local if self.topology.leader else {},
                                   "extra": extra if self.topology.leader else {}}, self.topology)
        totals: dict[str, list[float]] = {}
        for part in gathered:
            for name, row in part["rows"].items():
                acc = totals.setdefault(name, [0.0] * _COLUMNS)
                for i, v in enumerate(row):
                    acc[i] += v
        out: dict[str, float] = {}
        every = [0.0] * _COLUMNS

        def accuracies(row: list[float], suffix: str) -> None:  # over the episodes with a verdict only
            if row[7]:
                out[f"eval_accuracy{suffix}"] = row[1] / row[7]
            if greedy and row[8]:
                out[f"eval_greedy_accuracy{suffix}"] = row[6] / row[8]

        for name, row in sorted(totals.items()):
            for i, v in enumerate(row):
                every[i] += v
            if len(totals) > 1:
                accuracies(row, f"_{name}")
        accuracies(every, "")
        n = max(every[0], 1)
        out.update({"eval_reward": every[2] / n, "eval_response_length": every[3] / n,
                    "eval_truncation_rate": every[4] / n,
                    "eval_prompts": every[0] / self.config.samples_per_prompt, "eval_episodes": every[0],
                    # the weights evaluated (a disaggregated run checks its servers' per-token versions)
                    "eval_policy_version": float(self.engine.policy_version)})
        sums: dict[str, list[float]] = {}
        for part in gathered:
            for key, (total, count) in part["extra"].items():
                acc = sums.setdefault(key, [0.0, 0.0])
                acc[0] += total
                acc[1] += count
        for key, (total, count) in sorted(sums.items()):
            if count > 0:  # nothing measured (no held-out response at all): no metric rather than a 0
                out[f"eval_{key}"] = total / count
        return out

    def _teacher_metrics(self, items: list[EvalItem], pool, domain_of, groups) -> dict[str, list[float]]:
        """[total, count] of the three teacher metrics over this replica's ``items`` (module docstring)."""
        tp = groups.tp
        student = self.engine.model
        answers = self._teacher_greedy(pool, domain_of)
        metrics = ("student_logprob_teacher", "teacher_logprob_teacher", "kl_to_teacher")
        out = {key: [0.0, 0.0] for key in metrics}
        # Every domain's own figures beside the pooled ones when there are several (two experts,
        # one student: its distance to each teacher is what the distillation moves, Ch. 8)
        domains = {domain_of[name] for name in self.envs}
        for name in sorted({domain_of[it.dataset] for it in items}):
            own_keys = [f"{key}_{name}" for key in metrics] if len(domains) > 1 else []
            for key in own_keys:
                out[key] = [0.0, 0.0]

            def add(metric: str, pair: tuple[float, float]) -> None:
                _add(out[metric], pair)
                if own_keys:
                    _add(out[f"{metric}_{name}"], pair)

            teacher_name = pool.domain_teacher[name]
            temperature = pool.temperatures[teacher_name]
            chosen = [it for it in items if domain_of[it.dataset] == name]
            rows = [(it.prompt, answers[(it.dataset, it.index)]) for it in chosen]
            own = [(it.prompt, it.response) for it in chosen if it.response]
            add("student_logprob_teacher", _answer_logprob(student, rows, tp, 1.0))
            if teacher_name in pool.remote:
                served = pool.remote[teacher_name]
                if self.topology.leader:  # only the leaders' figures are gathered: one request per replica
                    add("teacher_logprob_teacher", _served_answer_logprob(served, rows))
                shard = _served_distribution_shard(served, self.engine.model_config.vocab_size, tp, groups)
            else:
                model_t = pool.teachers[teacher_name]
                add("teacher_logprob_teacher", _answer_logprob(model_t, rows, tp, temperature))
                shard = _in_process_shard(model_t, temperature)
            add("kl_to_teacher", _answer_kl(student, shard, own, tp))
        return out

    def _teacher_greedy(self, pool, domain_of) -> dict[tuple[str, int], list[int]]:
        """The teachers' greedy answers to this replica's held-out prompts (computed once: teachers
        are frozen). A served teacher's are asked by each replica's first rank and all-gathered."""
        if self._teacher_answers is not None:
            return self._teacher_answers
        answers: dict[tuple[str, int], list[int]] = {}
        served: list[list] = []
        mine = self.mine()
        for teacher_name in sorted({*pool.teachers, *pool.remote}):
            chosen = [it for it in mine if pool.domain_teacher[domain_of[it[0]]] == teacher_name]
            if not chosen:
                continue
            if teacher_name in pool.remote:
                if self.topology.leader:
                    played = self.play(pool.remote[teacher_name].engine(), chosen, 0.0)
                    served += [[it.dataset, it.index, it.response] for it in played]
                continue
            engine = InferenceEngine(pool.teachers[teacher_name],
                                     EngineConfig(max_num_seqs=self.engine.config.max_num_seqs,
                                                  max_model_len=self.max_model_len, max_waiting=100_000,
                                                  page_tokens=self.engine.config.page_tokens),
                                     eos_token_ids=self.engine.eos_token_ids)
            played = self.play(engine, chosen, 0.0)
            for it in played:
                answers[(it.dataset, it.index)] = it.response
        if pool.remote:  # collective on every rank (each replica's leader contributes its answers)
            for part in gather_objects(served, self.topology):
                for dataset, index, response in part:
                    answers[(dataset, index)] = response
        self._teacher_answers = answers
        return answers


class VerifiersEvaluator(Evaluator):
    """Held-out evaluation of verifiers environments (``environment.eval_taskset``): the same
    metrics, each held-out task played as a verifiers episode by the rollout backend — through the
    run's own server, training client and engine, exactly as the training episodes
    (:meth:`~megatron_s2.posttrain.rollout.vf_backend.VerifiersBackend.play_held_out`). Accuracy
    is the rubric's ``correct`` reward (left out when the rubric has none); reward is its weighted
    sum. No teacher metrics (OPD refuses evaluation on verifiers environments). Agentic environments
    are evaluated the same way: their back end
    (:class:`~megatron_s2.posttrain.rollout.agentic_backend.AgenticBackend`) plays the held-out
    instances through the in-process agent gateway; accuracy = graded 1."""

    def __init__(self, backend, environments: Mapping[str, PromptSet], topology: ReplicaTopology, config,
                 max_new_tokens: int):
        super().__init__(backend.engine, environments, topology, config, max_new_tokens,
                         max_model_len=backend.engine.config.max_model_len)
        self.backend = backend

    def play(self, engine: InferenceEngine, items: Sequence[tuple[str, int]], temperature: float) -> list[EvalItem]:
        samples = self.backend.play_held_out(items, temperature=temperature, max_tokens=self.max_new_tokens,
                                             seed=episode_seed)
        out = []
        for (name, index), s in zip(items, samples):
            start, end = s.spans[0]
            out.append(EvalItem(name, index, s.tokens[:start], s.tokens[start:end], s.correct, float(s.reward),
                                s.num_generated, s.finish_reason == "length", s.metrics))
        return out


def _add_metrics(acc: dict[str, list[float]], prefix: str, measured: Mapping[str, float]) -> None:
    for name, value in measured.items():
        _add(acc.setdefault(prefix + name, [0.0, 0.0]), (float(value), 1.0))


def _add(acc: list[float], measured: tuple[float, float]) -> None:
    acc[0] += measured[0]
    acc[1] += measured[1]


def _rows_to_batch(rows: Sequence[tuple[list[int], list[int]]]):
    width = max(len(p) + len(a) for p, a in rows) - 1
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (p, a) in enumerate(rows):
        ids = torch.tensor(p + a)
        n = ids.numel() - 1
        tokens[i, :n], labels[i, :n] = ids[:-1], ids[1:]
        mask[i, len(p) - 1:n] = True
    return tokens, labels, mask


@torch.no_grad()
def _answer_logprob(model, rows, tp, temperature: float, chunk: int = 32) -> tuple[float, float]:
    total = count = 0.0
    for i in range(0, len(rows), chunk):
        part = [r for r in rows[i:i + chunk] if r[1]]
        if not part:
            continue
        tokens, labels, mask = _rows_to_batch(part)
        dev = next(model.parameters()).device
        logits = full_logits(model, tokens.to(dev)) / temperature
        lp = token_log_probs(logits, labels.to(dev), tp, 1.0).cpu()
        total += float((lp * mask).sum())
        count += float(mask.sum())
    return total, count


@torch.no_grad()
def _answer_kl(student, teacher_shard, rows, tp, chunk: int = 32) -> tuple[float, float]:
    """Sum and count of the full-vocabulary KL(student || teacher) at every response position of
    ``rows``; ``teacher_shard(tokens, part)`` gives the teacher's logits (or log-probs) on this
    rank's vocabulary shard for a chunk's right-padded ``tokens`` [b, s] of rows ``part``."""
    total = count = 0.0
    for i in range(0, len(rows), chunk):
        part = rows[i:i + chunk]
        if not part:
            continue
        tokens, _, mask = _rows_to_batch(part)
        dev = next(student.parameters()).device
        tokens = tokens.to(dev)
        kl = vocab_parallel_kl(full_logits(student, tokens), teacher_shard(tokens, part).to(dev), tp).cpu()
        total += float((kl * mask).sum())
        count += float(mask.sum())
    return total, count


def _in_process_shard(teacher, temperature: float):
    """``teacher_shard`` of :func:`_answer_kl` for an in-process teacher: its logits / T."""
    return lambda tokens, rows: full_logits(teacher, tokens) / temperature


def _served_answer_logprob(teacher: RemoteTeacher, rows) -> tuple[float, float]:
    """Sum and count of log pi_T of the answer tokens of ``rows`` (prompt log-probs of prompt +
    answer, at the teacher's temperature, which its server applies)."""
    kept = [(p, a) for p, a in rows if a]
    values = teacher.score([p + a for p, a in kept])
    total = sum(sum(v[len(p) - 1:]) for (p, _), v in zip(kept, values))
    return float(total), float(sum(len(a) for _, a in kept))


def _served_distribution_shard(teacher: RemoteTeacher, vocab_size: int, tp, groups):
    """``teacher_shard`` of :func:`_answer_kl` for a served teacher: its full distribution after
    every prefix of the chunk's rows (asked by the replica's first rank, broadcast to the
    others), on this rank's vocabulary shard (zeros at padding, which the mask drops)."""
    part_size = vocab_size // tp.size
    start = tp.rank * part_size

    def shard(tokens: torch.Tensor, rows) -> torch.Tensor:
        b, s = tokens.shape

        def fetch() -> torch.Tensor:
            full = torch.zeros(b, s, vocab_size, dtype=torch.float32)
            for i, dist in enumerate(teacher.distributions([p + a for p, a in rows], vocab_size)):
                full[i, :dist.size(0)] = dist
            return full

        return once_per_replica(fetch, (b, s, vocab_size), groups)[..., start:start + part_size]

    return shard
