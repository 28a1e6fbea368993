"""Teacher trajectories of OPD's SFT warm-up (walkthrough Ch. 8: "we use the reasoning and agentic
experts to generate high-quality trajectories and perform a lightweight SFT warmup on the original
SFT model, and that becomes the initial student").

A :class:`Trajectory` is exactly the token ids of one teacher episode and a per-token loss mask
(1 on the tokens the teacher generated; prompt and environment/tool tokens 0). The trajectories
of warm-up step ``k`` are a pure function of (seed, k), so a run resumed inside the warm-up
trains the same rows as an uninterrupted one — no prompt repeated or skipped — with no state
beyond the step the checkpoint already holds:

* :class:`WarmupPrompts` — the training prompts of step ``k``: each row's dataset drawn by the
  rollout datasets' weights (one draw per step, stream ``WARMUP_DATASET``), each dataset read
  in a fresh permutation per epoch (stream ``WARMUP_ORDER``), positions counted over steps;
* :class:`TeacherGenerator` — the teacher of each row's domain plays the episode: an in-process
  teacher on an inference engine built over its resident weights, a served one on its server
  (:class:`~megatron_s2.posttrain.opd.remote_teacher.EndpointEngine`, the same loop; only a
  replica's first rank asks it, seeded per row and turn like the engine's requests); rows
  divided over the rollout replicas, results all-gathered as JSON, so every rank holds the
  whole global batch;
* :class:`TrajectoryFile` — ``opd.sft_warmup.data``: JSON lines ``{"tokens": [...],
  "loss_mask": [...]}`` (never pickled), read in epoch permutations (stream ``WARMUP_ORDER``).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from megatron_s2.config.schema import ConfigError
from megatron_s2.inference import EngineDriver, InferenceEngine, SamplingParams
from megatron_s2.posttrain.orchestrator.dispatch import counter_rng
from megatron_s2.posttrain.rollout.replicas import ReplicaTopology, gather_objects

__all__ = ["Trajectory", "WarmupPrompts", "TeacherGenerator", "TrajectoryFile", "WARMUP_DATASET", "WARMUP_ORDER",
           "WARMUP_SAMPLE"]

WARMUP_DATASET, WARMUP_ORDER, WARMUP_SAMPLE = 11, 12, 13
"""Counter-based random streams of the warm-up (distinct from the orchestrator's)."""


@dataclass
class Trajectory:
    tokens: list[int]
    """Token ids of the whole episode (prompt, teacher responses, environment tokens)."""
    loss_mask: list[int]
    """1 on tokens the teacher generated, 0 elsewhere (same length as ``tokens``)."""
    uid: str
    """Where the row came from (``dataset/index@epoch`` or ``file:line@epoch``), for the audit trail."""
    correct: bool | None = None
    """The environment's verdict on the teacher's episode, when generated."""


def _epoch_order(seed: int, key: int, epoch: int, size: int) -> np.ndarray:
    return counter_rng(seed, WARMUP_ORDER, key, epoch).permutation(size)


class _EpochReader:
    """Position -> (index, epoch) over epoch permutations of ``size`` items."""

    def __init__(self, seed: int, key: int, size: int):
        self.seed, self.key, self.size = seed, key, size
        self._orders: dict[int, np.ndarray] = {}

    def at(self, position: int) -> tuple[int, int]:
        epoch, offset = divmod(position, self.size)
        if epoch not in self._orders:
            self._orders = {epoch: _epoch_order(self.seed, self.key, epoch, self.size)}
        return int(self._orders[epoch][offset]), epoch


class WarmupPrompts:
    """The (dataset, prompt index, epoch) rows of each warm-up step (module docstring)."""

    def __init__(self, sizes: Mapping[str, int], weights: Mapping[str, float], seed: int, batch: int):
        self.names = list(sizes)
        if not self.names:
            raise ValueError("WarmupPrompts: no dataset")
        w = np.asarray([float(weights.get(n, 1.0)) for n in self.names], dtype=np.float64)
        self.p = w / w.sum()
        self.seed, self.batch = seed, batch
        self.readers = {n: _EpochReader(seed, zlib.crc32(n.encode()), sizes[n]) for n in self.names}
        self._starts: list[np.ndarray] = [np.zeros(len(self.names), dtype=np.int64)]  # per-dataset position per step

    def _choices(self, step: int) -> np.ndarray:
        if len(self.names) == 1:
            return np.zeros(self.batch, dtype=np.int64)
        return counter_rng(self.seed, WARMUP_DATASET, step).choice(len(self.names), size=self.batch, p=self.p)

    def step_rows(self, step: int) -> list[tuple[str, int, int]]:
        while len(self._starts) <= step:
            k = len(self._starts) - 1
            self._starts.append(self._starts[k] + np.bincount(self._choices(k), minlength=len(self.names)))
        position = self._starts[step].copy()
        rows = []
        for c in self._choices(step):
            name = self.names[int(c)]
            index, epoch = self.readers[name].at(int(position[c]))
            position[c] += 1
            rows.append((name, index, epoch))
        return rows


class TeacherGenerator:
    """Episodes of the warm-up prompts played by each row's domain teacher (module docstring)."""

    def __init__(self, teachers, domain_of: Mapping[str, str], environments, engine_config, eos_token_ids,
                 topology: ReplicaTopology, *, temperature: float, max_new_tokens: int, max_model_len: int,
                 seed: int):
        """``teachers``: the trainer's :class:`~megatron_s2.posttrain.frozen.TeacherPool`;
        ``domain_of``: dataset -> domain."""
        self.pool, self.domain_of, self.envs = teachers, dict(domain_of), environments
        self.engine_config, self.eos = engine_config, list(eos_token_ids)
        self.topology, self.temperature = topology, temperature
        self.max_new_tokens, self.max_model_len, self.seed = max_new_tokens, max_model_len, seed
        self._engines: dict = {}

    def _engine(self, teacher: str):
        if teacher not in self._engines:  # built once, over the teacher's resident weights or its server
            self._engines[teacher] = (self.pool.remote[teacher].engine() if teacher in self.pool.remote else
                                      InferenceEngine(self.pool.teachers[teacher], self.engine_config,
                                                      eos_token_ids=self.eos))
        return self._engines[teacher]

    def close(self) -> None:
        """Release the engines' KV pools (after the last warm-up step)."""
        self._engines.clear()

    def generate(self, step: int, rows: Sequence[tuple[str, int, int]]) -> list[Trajectory]:
        """Every row of the step (collective over the world: rows divided over the replicas)."""
        mine = [j for j in range(len(rows)) if self.topology.owns(j)]
        played: dict[int, Trajectory] = {}
        by_teacher: dict[str, list[int]] = {}
        for j in mine:
            by_teacher.setdefault(self.pool.domain_teacher[self.domain_of[rows[j][0]]], []).append(j)
        for teacher, js in sorted(by_teacher.items()):
            if teacher in self.pool.remote and not self.topology.leader:
                continue  # one request per row: only the replica leaders' trajectories are gathered
            played.update(self._play(self._engine(teacher), step, rows, js))
        local = [[j, t.tokens, t.loss_mask, t.correct] for j, t in sorted(played.items())]
        out: dict[int, Trajectory] = {}
        for part in gather_objects(local if self.topology.leader else [], self.topology):
            for j, tokens, mask, correct in part:
                name, index, epoch = rows[j]
                out[j] = Trajectory(tokens, mask, f"{name}/{index}@{epoch}", correct)
        if len(out) != len(rows):
            raise RuntimeError(f"sft warm-up: {len(out)} of {len(rows)} trajectories came back from the replicas")
        return [out[j] for j in range(len(rows))]

    def _play(self, engine, step: int, rows, js: list[int]) -> dict[int, Trajectory]:
        """Full episodes (multi-turn included: environment tokens masked) of rows ``js``."""
        state: dict[int, dict] = {}
        outputs: dict[str, list[int]] = {}
        finished: list[tuple[str, str]] = []
        done: dict[int, Trajectory] = {}

        def on_output(out) -> None:
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                finished.append((out.request_id, out.finish_reason.value))

        def call(j: int, turn: int) -> None:
            s = state[j]
            room = self.max_model_len - len(s["tokens"])
            seed = int(counter_rng(self.seed, WARMUP_SAMPLE, step, j, turn).integers(0, 2 ** 31 - 1))
            params = SamplingParams(max_tokens=max(1, min(self.max_new_tokens, room)), temperature=self.temperature,
                                    seed=seed)
            engine.add_request(list(s["tokens"]), params, request_id=f"warmup-{step}-{j}-{turn}", on_output=on_output)

        for j in js:
            name, index, _ = rows[j]
            episode = self.envs[name].episode(index, "train")
            prompt = list(episode.prompt_tokens())
            state[j] = {"j": j, "episode": episode, "tokens": prompt, "mask": [0] * len(prompt), "turn": 0}
            call(j, 0)
        driver = EngineDriver(engine)
        while engine.has_work():
            driver.step()
            ended, finished[:] = list(finished), []
            for rid, reason in ended:
                j, turn = (int(x) for x in rid.split("-")[2:4])
                s = state[j]
                ids = outputs.pop(rid, [])
                s["tokens"] += ids
                s["mask"] += [1] * len(ids)
                result = s["episode"].step(ids, reason)
                if not result.done and len(s["tokens"]) + len(result.delta) + 1 < self.max_model_len:
                    s["tokens"] += list(result.delta)
                    s["mask"] += [0] * len(result.delta)
                    call(j, turn + 1)
                    continue
                done[j] = Trajectory(s["tokens"], s["mask"], "", None if result.correct is None else bool(result.correct))
        return done


class TrajectoryFile:
    """``opd.sft_warmup.data``: teacher trajectories from a JSON-lines file (module docstring)."""

    FIELD = "opd.sft_warmup.data"

    def __init__(self, path: str | Path, *, vocab_size: int, max_tokens: int, seed: int):
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{self.FIELD}: {path} is not a file; give a JSON-lines file of teacher trajectories "
                              "({\"tokens\": [...], \"loss_mask\": [...]} per line) or data: '' to generate them")
        self.rows: list[tuple[list[int], list[int]]] = []
        with open(path, "rb") as f:  # bytes: a binary file (e.g. a pickle) is refused per line, never decoded
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8-sig")  # -sig: a leading BOM (Windows editors) is no error
                except UnicodeDecodeError:
                    raise ConfigError(f"{self.FIELD}: {path} line {n}: not UTF-8 text (a binary or pickled file?); "
                                      "give JSON lines {\"tokens\": [...], \"loss_mask\": [...]}") from None
                if line.strip():
                    self.rows.append(self._parse(path, n, line, vocab_size, max_tokens))
        if not self.rows:
            raise ConfigError(f"{self.FIELD}: {path} holds no trajectory")
        self.reader = _EpochReader(seed, zlib.crc32(b"sft_warmup.data"), len(self.rows))

    def _parse(self, path: Path, n: int, line: str, vocab_size: int, max_tokens: int) -> tuple[list[int], list[int]]:
        where = f"{self.FIELD}: {path} line {n}"
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: hostile nesting
            raise ConfigError(f"{where}: not JSON; each line is {{\"tokens\": [...], \"loss_mask\": [...]}}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("tokens"), list) or not isinstance(obj.get("loss_mask"), list):
            raise ConfigError(f"{where}: needs the lists 'tokens' and 'loss_mask'")
        tokens, mask = obj["tokens"], obj["loss_mask"]
        if not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
            raise ConfigError(f"{where}: 'tokens' must be integer ids in [0, {vocab_size}) (the policy's vocabulary)")
        if len(mask) != len(tokens) or not all(m in (0, 1) and type(m) is int for m in mask):
            raise ConfigError(f"{where}: 'loss_mask' must hold one 0/1 per token ({len(tokens)} tokens)")
        if not 2 <= len(tokens) <= max_tokens:
            raise ConfigError(f"{where}: {len(tokens)} tokens; a row holds 2..training.seq_length + 1 = {max_tokens}")
        if not any(mask[1:]):
            raise ConfigError(f"{where}: no loss-bearing token after the first (loss_mask is 1 on the teacher's "
                              "response tokens)")
        return list(tokens), list(mask)

    def step_rows(self, step: int, batch: int) -> list[Trajectory]:
        out = []
        for position in range(step * batch, (step + 1) * batch):
            line, epoch = self.reader.at(position)
            tokens, mask = self.rows[line]
            out.append(Trajectory(tokens, mask, f"file:{line}@{epoch}"))
        return out
