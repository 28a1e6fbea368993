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
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from megatron_s2.config.schema import ConfigError
from megatron_s2.runtime.finite import TrainingHalted

__all__ = ["RemoteTeacher", "RemoteTeacherError", "once_per_replica"]

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

    # ---- start-up ----------------------------------------------------------------------------
    def connect(self, vocab_size: int | None = None) -> "RemoteTeacher":
        """Check once that the endpoint serves a model and returns prompt log-probs (and, given
        the student's ``vocab_size``, accepts its largest token id: a teacher shares the
        tokenizer); ConfigError (exit 2, one line naming the field) otherwise."""
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
                "prompt_logprobs": 0}
        if self.model is not None:
            body["model"] = self.model
        if self.temperature != 1.0:
            body["prompt_logprobs_temperature"] = self.temperature
        reply = self._post(f"{self.base_url}/completions", body)
        choices = reply.get("choices")
        if not isinstance(choices, list) or len(choices) != len(seqs):
            raise RemoteTeacherError(f"{self.field}: {_length(choices)} choices for {len(seqs)} prompts")
        by_index = {c.get("index"): c for c in choices if isinstance(c, dict)}
        out = []
        for i, ids in enumerate(seqs):
            entries = (by_index.get(i) or {}).get("prompt_logprobs")
            if not isinstance(entries, list) or len(entries) != len(ids):
                raise RemoteTeacherError(f"{self.field}: choices[{i}].prompt_logprobs has {_length(entries)} entries "
                                         f"for a prompt of {len(ids)} tokens")
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
        k = self.rows_per_request
        chunks = [seqs[j:j + k] for j in range(0, len(seqs), k)]
        values = [v for part in self._pool.map(self.batch_logprobs, chunks) for v in part]
        out = torch.zeros(b, s, dtype=torch.float32)
        for i, v in zip(rows, values):
            out[i, :len(v)] = torch.tensor(v, dtype=torch.float32)
        return out.to(tokens.device)

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
                if reply.status_code == 200:
                    return _json(reply)
                last = f"HTTP {reply.status_code}: {_error_message(reply)}"
                if reply.status_code not in _RETRY_STATUS:
                    break
            if attempt < self.retries:
                time.sleep(delay)
                delay *= 2
        raise RemoteTeacherError(f"{self.field}: POST {url} failed ({last})")


def once_per_replica(fetch, shape: tuple[int, int], groups) -> torch.Tensor:
    """``fetch()`` ([b, s] float32) on the replica's first rank (tp = cp = pp rank 0), broadcast
    down pipeline, context and tensor groups in that order (each group's source already holds
    it); a failure of ``fetch`` is raised on every rank of the replica. ``groups``: the
    trainer's ParallelGroups (None: this rank alone)."""
    tp, cp, pp = (groups.tp, groups.cp, groups.pp) if groups is not None else (None, None, None)
    if groups is None or not (tp.active or cp.active or pp.active):
        return fetch()
    import torch.distributed as dist

    from megatron_s2.posttrain.train_batch import g_device

    leader = tp.rank == 0 and cp.rank == 0 and pp.rank == 0
    buf = torch.zeros(shape[0] * shape[1] + 1, dtype=torch.float32)
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
