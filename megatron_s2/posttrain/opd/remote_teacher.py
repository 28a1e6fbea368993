"""A sampled-token OPD teacher reached over an OpenAI-compatible endpoint (walkthrough Ch. 8).

Sampled-token OPD needs only the teacher's log-probability of each token the student sampled
(**Eq. 33**: A = sg[log pi_T(y_t | ...) - log pi_prox(y_t | ...)]) — one number per token, the
O(H) payload of worked example 24, not the O(H V) distribution. So a teacher need not live in
the trainer's process: any server with vLLM's ``prompt_logprobs`` returns exactly that number
when it is handed the whole sequence (prompt + student response) as a token-id prompt.

:class:`RemoteTeacher` POSTs ``/completions`` with ``prompt`` = the token ids of up to
``rows_per_request`` training rows (a list of token-id lists, used verbatim: no
re-tokenisation, no BOS added; ``megatron-s2 serve`` scores them in one batched forward),
``max_tokens: 1`` (the minimum a completion generates; greedy), ``prompt_logprobs: 0`` (the
actual token only) and, for a
teacher temperature other than 1, ``prompt_logprobs_temperature: T`` — **the server applies
the temperature** (it holds the logits; ``log_softmax(logits / T)`` of one token cannot be
rebuilt from that token's log-prob alone). ``megatron-s2 serve`` honours it; a vLLM server
returns raw (T = 1) prompt log-probs, so use T = 1 with one. Requests run concurrently on a
bounded pool (``max_concurrent_requests`` in flight), each with a timeout; 429 / 503 /
connection failures are retried a few times, then the step fails with one line naming the
teacher's field.

The result has the in-process teacher's layout (:meth:`TeacherPool.token_logprobs`): a
``[b, s]`` float32 tensor of log pi_T(labels[i, t]) at every label the loss can see (up to the
row's last ``loss_mask`` position; 0 after it), so :func:`opd_advantages` consumes it unchanged.
At start-up (:meth:`RemoteTeacher.connect`) the endpoint is checked once — reachable, serving
a model, returning prompt log-probs — or the trainer exits 2 with one line naming
``opd.teachers.<name>.endpoint``.

Every rank of a data-parallel replica (tensor x context x pipeline) holds the same micro-batch;
:func:`once_per_replica` lets only the replica's first rank send the requests and broadcasts
the log-probs (and a failure, so that no rank waits forever) to the others.

The same client serves what else a run asks of its teachers, so that a served teacher gives
what an in-process one gives:

* generation — :meth:`RemoteTeacher.complete` (``/completions`` with a token-id prompt,
  ``return_token_ids``; greedy at temperature 0, else seeded) and :class:`EndpointEngine`, which
  drives it like an :class:`~megatron_s2.inference.InferenceEngine` so that the loops that play
  episodes on an engine (the held-out evaluation's teacher answers, the SFT warm-up's teacher
  trajectories) play them on the teacher's server unchanged, multi-turn included;
* the full distribution — :meth:`RemoteTeacher.distributions`: ``prompt_logprobs`` with k = the
  vocabulary size, every token's log-prob at every position (what the evaluation's
  full-vocabulary KL needs; worked example 24's O(HV) payload, paid at evaluation only). A
  server returns it when its cap allows (``megatron-s2 serve --max-logprobs -1``, vLLM's flag of
  the same name); :meth:`RemoteTeacher.connect` checks that once when the run will need it.

:attr:`RemoteTeacher.response_bytes` counts the bytes of the server's answers (the JSON that
actually travelled), reported per step as ``opd_teacher_http_bytes``
(:mod:`~megatron_s2.posttrain.opd.payload`).
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple

import torch

from megatron_s2.config.schema import ConfigError
from megatron_s2.inference import FinishReason, RequestOutput, SamplingParams
from megatron_s2.runtime.finite import TrainingHalted

__all__ = ["RemoteTeacher", "RemoteTeacherError", "EndpointEngine", "once_per_replica"]

_RETRY_STATUS = {429, 502, 503, 504}


class RemoteTeacherError(TrainingHalted):
    """A remote teacher failed during training (after its retries): the run stops with one line
    naming the teacher's field, exit code 1 (its last committed checkpoint resumes it)."""


class RemoteTeacher:
    """One teacher behind an OpenAI-compatible ``base_url`` (``http://host:port/v1``)."""

    def __init__(self, name: str, base_url: str, *, temperature: float = 1.0, timeout_s: float = 60.0,
                 max_concurrent_requests: int = 8, rows_per_request: int = 8, retries: int = 3):
        import httpx

        self.name, self.base_url = name, base_url.rstrip("/")
        self.temperature, self.timeout_s, self.retries = float(temperature), float(timeout_s), int(retries)
        self.field = f"opd.teachers.{name}.endpoint"
        self.max_concurrent_requests, self.rows_per_request = int(max_concurrent_requests), int(rows_per_request)
        self._client = httpx.Client(timeout=httpx.Timeout(self.timeout_s),
                                    limits=httpx.Limits(max_connections=self.max_concurrent_requests,
                                                        max_keepalive_connections=self.max_concurrent_requests))
        self._pool = ThreadPoolExecutor(max_workers=self.max_concurrent_requests,
                                        thread_name_prefix=f"teacher-{name}")
        self.model: str | None = None
        self.requests = 0
        self.response_bytes = 0
        """Bytes of every answer the server sent (HTTP bodies), for the payload metric."""

    # ---- start-up ----------------------------------------------------------------------------
    def connect(self, vocab_size: int | None = None, full_distribution: bool = False) -> "RemoteTeacher":
        """Check once that the endpoint serves a model and returns prompt log-probs (and, given
        the student's ``vocab_size``, accepts its largest token id: a teacher shares the
        tokenizer; with ``full_distribution``, returns all ``vocab_size`` of them per position);
        ConfigError (exit 2, one line naming the field) otherwise."""
        import httpx

        url = f"{self.base_url}/models"
        try:
            reply = self._client.get(url, timeout=min(self.timeout_s, 10.0))
        except httpx.HTTPError as exc:
            self.close()
            raise ConfigError(f"{self.field}: cannot reach {url} ({_reason(exc)}); start the teacher's server "
                              "(megatron-s2 serve <teacher checkpoint> --port N) and give its http://host:N/v1"
                              ) from None
        models = _json(reply).get("data") if reply.status_code == 200 else None
        if not models or not isinstance(models, list) or not isinstance(models[0], dict) or "id" not in models[0]:
            self.close()
            raise ConfigError(f"{self.field}: {url} answered HTTP {reply.status_code} without a model list; give the "
                              "OpenAI-compatible base URL of the teacher's server (ending in /v1)")
        self.model = str(models[0]["id"])
        try:
            probe = self.sequence_logprobs([0, 0])
        except RemoteTeacherError as exc:
            self.close()
            raise ConfigError(f"{self.field}: {self.base_url} does not return prompt log-probs ({exc}); serve the "
                              "teacher with megatron-s2 serve or vLLM (prompt_logprobs)") from None
        if len(probe) != 1:
            self.close()
            raise ConfigError(f"{self.field}: {self.base_url} returned {len(probe)} prompt log-probs for a 2-token "
                              "prompt (expected 1); the server's prompt_logprobs do not follow vLLM's layout")
        if vocab_size:
            try:
                self.sequence_logprobs([0, vocab_size - 1])
            except RemoteTeacherError as exc:
                self.close()
                raise ConfigError(f"{self.field}: {self.base_url} refuses the student's token id {vocab_size - 1} "
                                  f"({exc}); a teacher must share the student's tokenizer") from None
        if full_distribution:
            if not vocab_size:
                raise ValueError("RemoteTeacher.connect: full_distribution needs the student's vocab_size")
            try:
                self.distributions([[0, 0]], vocab_size)
            except RemoteTeacherError as exc:
                self.close()
                why = str(exc).removeprefix(f"{self.field}: ")
                raise ConfigError(f"{self.field}: {self.base_url} does not return the teacher's full distribution "
                                  f"({why}), which the held-out evaluation's eval_kl_to_teacher needs; serve the "
                                  "teacher with --max-logprobs -1 (megatron-s2 serve, vLLM) or turn the evaluation "
                                  "off (opd.eval.interval=0 opd.eval.at_start=false)") from None
        return self

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._client.close()

    # ---- scoring -------------------------------------------------------------------------------
    def sequence_logprobs(self, ids: list[int]) -> list[float]:
        """log pi_T(ids[p] | ids[:p]) for p = 1 .. len(ids) - 1 (one request)."""
        return self.batch_logprobs([ids])[0]

    def batch_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        """:meth:`sequence_logprobs` of several sequences in one request (a list of token-id
        prompts; choice i answers prompt i, as in vLLM)."""
        body = {"prompt": [[int(t) for t in ids] for ids in seqs], "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 0, **self._model_field(), **self._temperature_field()}
        out = []
        for ids, entries in zip(seqs, self._prompt_entries(body, seqs)):
            values = []
            for p in range(1, len(ids)):
                value = (entries[p] or {}).get(str(ids[p]))
                if not isinstance(value, dict) or not isinstance(value.get("logprob"), (int, float)):
                    raise RemoteTeacherError(f"{self.field}: prompt_logprobs[{p}] lacks the prompt's token {ids[p]}")
                values.append(float(value["logprob"]))
            out.append(values)
        return out

    def token_logprobs(self, tokens: torch.Tensor, labels: torch.Tensor,
                       loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[b, s] float32 log pi_T(labels[i, t] | tokens[i, :t + 1]) for every row, up to its last
        ``loss_mask`` position (the whole row without a mask); 0 elsewhere. Rows are scored
        concurrently, at most ``max_concurrent_requests`` in flight."""
        if tokens.shape != labels.shape:
            raise ValueError(f"tokens {tuple(tokens.shape)} vs labels {tuple(labels.shape)}")
        b, s = tokens.shape
        toks, labs = tokens.cpu().tolist(), labels.cpu().tolist()
        if loss_mask is None:
            ends = [s] * b
        else:
            mask = loss_mask.bool().cpu()
            pos = torch.arange(1, s + 1).expand(b, s)
            ends = (pos * mask).max(dim=1).values.tolist()
        rows = [i for i, n in enumerate(ends) if n > 0]
        seqs = [toks[i][:ends[i]] + [labs[i][ends[i] - 1]] for i in rows]
        values = self.score(seqs)
        out = torch.zeros(b, s, dtype=torch.float32)
        for i, v in zip(rows, values):
            out[i, :len(v)] = torch.tensor(v, dtype=torch.float32)
        return out.to(tokens.device)

    def score(self, seqs: list[list[int]]) -> list[list[float]]:
        """:meth:`sequence_logprobs` of every sequence: ``rows_per_request`` per request, at most
        ``max_concurrent_requests`` requests in flight."""
        return [v for part in self._pool.map(self.batch_logprobs, self._chunks(seqs)) for v in part]

    def distributions(self, seqs: list[list[int]], vocab_size: int) -> list[torch.Tensor]:
        """The teacher's full distribution after every prefix: per sequence a [len - 1, V]
        float32 tensor whose row p - 1 is log pi_T(. | ids[:p]) over the whole vocabulary (at the
        teacher's temperature; logits / T from a server in a ``*_logits`` mode, which a KL's
        log-softmax treats alike). ``prompt_logprobs`` with k = ``vocab_size``."""
        def one_request(chunk: list[list[int]]) -> list[torch.Tensor]:
            body = {"prompt": [[int(t) for t in ids] for ids in chunk], "max_tokens": 1, "temperature": 0.0,
                    "prompt_logprobs": int(vocab_size), **self._model_field(), **self._temperature_field()}
            return [self._distribution(entries, len(ids), vocab_size, i)
                    for i, (ids, entries) in enumerate(zip(chunk, self._prompt_entries(body, chunk)))]

        return [d for part in self._pool.map(one_request, self._chunks(seqs)) for d in part]

    def complete(self, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
        """One generation from the token-id ``prompt`` (used verbatim): its token ids and finish
        reason ("stop" / "length"). ``params``: max_tokens, temperature (0 = greedy), top_p,
        top_k, seed and ignore_eos are sent; the rest must be at their defaults."""
        extra = [f for f in ("stop", "stop_token_ids", "logprobs", "logprob_token_ids", "record_routing",
                             "record_indexer_topk") if getattr(params, f) != getattr(SamplingParams(), f)]
        if extra:
            raise ValueError(f"RemoteTeacher.complete: {extra} are not sent to the teacher's server")
        body = {"prompt": [int(t) for t in prompt], "max_tokens": params.max_tokens,
                "temperature": params.temperature, "return_token_ids": True, **self._model_field()}
        for name in ("top_p", "top_k", "ignore_eos", "seed"):  # sent when set (servers differ on neutral values)
            if getattr(params, name) != getattr(SamplingParams(), name):
                body[name] = getattr(params, name)
        choices = self._post(f"{self.base_url}/completions", body).get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        ids, reason = choice.get("token_ids"), choice.get("finish_reason")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids) or reason not in ("stop", "length"):
            raise RemoteTeacherError(f"{self.field}: a completion without token_ids and a finish_reason of stop or "
                                     "length (the server must honour vLLM's return_token_ids)")
        return ids, reason

    def engine(self) -> "EndpointEngine":
        """This teacher's server, driven like an inference engine (:class:`EndpointEngine`)."""
        return EndpointEngine(self)

    # ---- requests ------------------------------------------------------------------------------
    def _chunks(self, seqs: list[list[int]]) -> list[list[list[int]]]:
        k = self.rows_per_request
        return [seqs[j:j + k] for j in range(0, len(seqs), k)]

    def _model_field(self) -> dict:
        return {"model": self.model} if self.model is not None else {}

    def _temperature_field(self) -> dict:
        # the server applies the teacher's temperature: it holds the logits (module docstring)
        return {"prompt_logprobs_temperature": self.temperature} if self.temperature != 1.0 else {}

    def _prompt_entries(self, body: dict, seqs: list[list[int]]) -> list[list]:
        """Each prompt's ``prompt_logprobs`` list from one request (choice i answers prompt i)."""
        choices = self._post(f"{self.base_url}/completions", body).get("choices")
        if not isinstance(choices, list) or len(choices) != len(seqs):
            raise RemoteTeacherError(f"{self.field}: {_length(choices)} choices for {len(seqs)} prompts")
        by_index = {c.get("index"): c for c in choices if isinstance(c, dict)}
        out = []
        for i, ids in enumerate(seqs):
            entries = (by_index.get(i) or {}).get("prompt_logprobs")
            if not isinstance(entries, list) or len(entries) != len(ids):
                raise RemoteTeacherError(f"{self.field}: choices[{i}].prompt_logprobs has {_length(entries)} entries "
                                         f"for a prompt of {len(ids)} tokens")
            out.append(entries)
        return out

    def _distribution(self, entries: list, length: int, vocab_size: int, prompt: int) -> torch.Tensor:
        rows = []
        for p in range(1, length):
            entry = entries[p] if isinstance(entries[p], dict) else {}
            try:
                rows.append([float(entry[str(t)]["logprob"]) for t in range(vocab_size)])
            except (KeyError, TypeError, ValueError):
                raise RemoteTeacherError(f"{self.field}: choices[{prompt}].prompt_logprobs[{p}] holds {len(entry)} of "
                                         f"the {vocab_size} tokens") from None
        return torch.tensor(rows, dtype=torch.float32).view(length - 1, vocab_size)

    def _post(self, url: str, body: dict) -> dict:
        import httpx

        delay, last = 0.25, ""
        for attempt in range(self.retries + 1):
            self.requests += 1
            try:
                reply = self._client.post(url, json=body)
            except httpx.HTTPError as exc:
                last = _reason(exc)
            else:
                self.response_bytes += len(reply.content)
                if reply.status_code == 200:
                    return _json(reply)
                last = f"HTTP {reply.status_code}: {_error_message(reply)}"
                if reply.status_code not in _RETRY_STATUS:
                    break
            if attempt < self.retries:
                time.sleep(delay)
                delay *= 2
        raise RemoteTeacherError(f"{self.field}: POST {url} failed ({last})")


class _Queued(NamedTuple):
    prompt: list[int]
    params: SamplingParams
    request_id: str
    on_output: Callable[[RequestOutput], None]


class EndpointEngine:
    """A :class:`RemoteTeacher`'s server behind the part of the
    :class:`~megatron_s2.inference.InferenceEngine` interface that an episode loop uses:
    ``add_request`` queues, ``step`` sends every queued request (at most
    ``max_concurrent_requests`` in flight; the server batches them) and reports each as one
    finished :class:`~megatron_s2.inference.RequestOutput`, in the order they were added;
    ``has_work`` says whether any is queued (a callback may queue the episode's next turn)."""

    def __init__(self, teacher: RemoteTeacher):
        self.teacher = teacher
        self._queued: list[_Queued] = []

    def add_request(self, prompt: list[int], params: SamplingParams, *, request_id: str,
                    on_output: Callable[[RequestOutput], None]) -> None:
        self._queued.append(_Queued(list(prompt), params, request_id, on_output))

    def has_work(self) -> bool:
        return bool(self._queued)

    def step(self) -> None:
        batch, self._queued = self._queued, []
        results = list(self.teacher._pool.map(lambda q: self.teacher.complete(q.prompt, q.params), batch))
        for queued, (ids, reason) in zip(batch, results):
            queued.on_output(RequestOutput(queued.request_id, token_ids=ids, finished=True,
                                           finish_reason=FinishReason(reason)))


def once_per_replica(fetch, shape: tuple[int, ...], groups) -> torch.Tensor:
    """``fetch()`` (float32 of ``shape``) on the replica's first rank (tp = cp = pp rank 0), broadcast
    down pipeline, context and tensor groups in that order (each group's source already holds
    it); a failure of ``fetch`` is raised on every rank of the replica. ``groups``: the
    trainer's ParallelGroups (None: this rank alone)."""
    tp, cp, pp = (groups.tp, groups.cp, groups.pp) if groups is not None else (None, None, None)
    if groups is None or not (tp.active or cp.active or pp.active):
        return fetch()
    import torch.distributed as dist

    from megatron_s2.posttrain.train_batch import g_device

    leader = tp.rank == 0 and cp.rank == 0 and pp.rank == 0
    buf = torch.zeros(math.prod(shape) + 1, dtype=torch.float32)
    failure = None
    if leader:
        try:
            buf[1:] = fetch().float().cpu().flatten()
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the others have heard of it
            failure, buf[0] = exc, 1.0
    buf = buf.to(g_device(groups))
    if tp.rank == 0 and cp.rank == 0 and pp.active:
        dist.broadcast(buf, src=pp.ranks[0], group=pp.pg)
    if tp.rank == 0 and cp.active:
        dist.broadcast(buf, src=cp.ranks[0], group=cp.pg)
    if tp.active:
        dist.broadcast(buf, src=tp.ranks[0], group=tp.pg)
    buf = buf.cpu()
    if buf[0] != 0:
        if failure is not None:
            raise failure
        raise RemoteTeacherError("a remote teacher failed on this replica's first rank (its error says why)")
    return buf[1:].view(shape)


def _json(reply) -> dict:
    try:
        value = reply.json()
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _error_message(reply) -> str:
    err = _json(reply).get("error")
    message = err.get("message") if isinstance(err, dict) else None
    return " ".join(str(message or reply.text[:200]).split())


def _reason(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _length(value) -> str:
    return str(len(value)) if isinstance(value, list) else "no"
