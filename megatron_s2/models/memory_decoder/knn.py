"""The token-level datastore and the retrieval distribution (Intern-S2 walkthrough Ch. 2, Eq. 1).

Step 1 (datastore): walk every position t of the domain corpus; the key is the frozen backbone's
representation of the prefix (its final, normalised hidden state — what the LM head reads) and the
value is the token that followed. Step 2 (Eq. 1): for a query prefix, take its k nearest keys
N(k_t) and let them vote, weighted by distance:

    p_kNN(y | c_t)  ∝  sum_{(k_j, v_j) in N(k_t)} 1[y = v_j] exp(-d(k_t, k_j) / tau)

d is the squared Euclidean distance (kNN-LM's convention, also what FAISS's L2 index returns).
Search here is exhaustive brute force, chunked over the keys, with the candidates re-ranked in
float64 so the neighbour set does not depend on float32 cancellation; a FAISS index is a drop-in replacement at scale
(optional, not required: the datastores of the CPU recipes are small).

The datastore is stored as safetensors (``keys`` float32 [N, D], ``values`` int64 [N]) with a
string metadata fingerprint of what built it, so a stale cache is detected and never unpickled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["Datastore", "knn_distribution", "knn_log_probs", "DatastoreError"]


class DatastoreError(ValueError):
    """A datastore file that is missing, malformed or built from something else (one line)."""


def knn_log_probs(distances: torch.Tensor, values: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """log p_kNN [..., V] of Eq. (1) from the k neighbours' ``distances`` [..., k] and stored next
    tokens ``values`` [..., k]. Tokens no neighbour voted for get -inf."""
    if not temperature > 0:
        raise ValueError(f"knn temperature must be positive, got {temperature}")
    # softmax over the neighbours first (stable: the nearest neighbour has weight exp(0)), then
    # group the votes by token: a scatter-add of the normalised weights.
    weights = torch.softmax(-distances.double() / temperature, dim=-1)
    probs = torch.zeros(*values.shape[:-1], vocab_size, dtype=torch.float64, device=values.device)
    probs.scatter_add_(-1, values.long(), weights)
    return probs.log().to(distances.dtype)


def knn_distribution(distances: torch.Tensor, values: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """p_kNN [..., V] of Eq. (1) (see :func:`knn_log_probs`)."""
    return knn_log_probs(distances, values, vocab_size, temperature).exp()


@dataclass
class Datastore:
    """(key, next token) pairs of a domain corpus under a frozen backbone (module docstring)."""

    keys: torch.Tensor      # [N, D] float32
    values: torch.Tensor    # [N] int64
    meta: dict = field(default_factory=dict)
    """What built it (backbone checkpoint, corpus, seed); compared by :meth:`load`."""

    def __post_init__(self) -> None:
        self._key_sq: torch.Tensor | None = None  # ||k||^2 of every key, computed at the first search
        if self.keys.dim() != 2 or self.values.dim() != 1 or self.keys.size(0) != self.values.size(0):
            raise DatastoreError(f"datastore: keys must be [N, D] and values [N], got {tuple(self.keys.shape)} "
                                 f"and {tuple(self.values.shape)}")
        if self.keys.size(0) == 0:
            raise DatastoreError("datastore: empty (the domain corpus produced no positions)")

    def __len__(self) -> int:
        return self.keys.size(0)

    def search(self, queries: torch.Tensor, k: int, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
        """(squared L2 distances [..., k] ascending, next tokens [..., k]) of the ``k`` nearest keys of
        each query [..., D] — exhaustive, no approximation. Keys are scanned ``chunk`` at a time in
        float32 (one matrix product per chunk) with a running top-(k + margin) merge, so memory is
        O(M * (chunk + k)) whatever the datastore size; the candidates' distances are then
        recomputed in float64 from the differences and re-ranked, so float32 cancellation in
        ||q||^2 - 2 q.k + ||k||^2 can neither reorder the neighbours nor perturb their weights.
        The keys stay where they are (host memory): each chunk, and the candidates' keys, are copied
        to the queries' device when read, so a GPU holds ``chunk`` keys and the N key norms, never the
        datastore (what `plan memory` assumes)."""
        if not 0 < k <= len(self):
            raise ValueError(f"knn k must be in [1, {len(self)}] (the datastore size), got {k}")
        q = queries.reshape(-1, queries.size(-1)).float()

        def keys_at(rows) -> torch.Tensor:
            return self.keys[rows].to(q.device, torch.float32)

        if self._key_sq is None or self._key_sq.device != q.device:
            self._key_sq = torch.cat([(c * c).sum(-1) for c in (keys_at(slice(start, start + chunk))
                                                                for start in range(0, len(self), chunk))])
        wanted = min(len(self), k + 8)  # margin for float32 ties at the k-th place
        best_d = q.new_full((q.size(0), 0), float("inf"))
        best_i = torch.empty(q.size(0), 0, dtype=torch.long, device=q.device)
        for start in range(0, len(self), chunk):
            keys = keys_at(slice(start, start + chunk))
            d = torch.addmm(self._key_sq[start:start + chunk].unsqueeze(0), q, keys.T, alpha=-2.0)
            chunk_d, chunk_i = d.topk(min(wanted, d.size(1)), dim=1, largest=False, sorted=False)
            # merge the chunk's candidates into the running ones (small tensors only)
            d, idx = torch.cat([best_d, chunk_d], dim=1), torch.cat([best_i, chunk_i + start], dim=1)
            best_d, pos = d.topk(min(wanted, d.size(1)), dim=1, largest=False, sorted=False)
            best_i = idx.gather(1, pos)
        # exact re-rank of the candidates in float64
        exact = ((keys_at(best_i.to(self.keys.device)).double() - q.double().unsqueeze(1)) ** 2).sum(-1)
        exact, order = exact.topk(k, dim=1, largest=False, sorted=True)
        best_i = best_i.gather(1, order)
        values = self.values[best_i.to(self.values.device)].to(q.device)
        shape = (*queries.shape[:-1], k)
        return exact.to(queries.dtype).reshape(shape), values.reshape(shape)

    def distribution(self, queries: torch.Tensor, k: int, vocab_size: int, temperature: float) -> torch.Tensor:
        """log p_kNN [..., V] (Eq. 1) of each query [..., D]."""
        distances, values = self.search(queries, k)
        return knn_log_probs(distances.double(), values, vocab_size, temperature).float()

    # ---- storage: safetensors, never pickle ----------------------------------------------------
    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file({"keys": self.keys.float().contiguous().cpu(), "values": self.values.long().contiguous().cpu()},
                  str(tmp), metadata={"meta": json.dumps(self.meta, sort_keys=True)})
        tmp.replace(path)  # a killed save leaves no half-written datastore under the real name

    @classmethod
    def load(cls, path: Path, expect_meta: dict | None = None) -> "Datastore":
        """The datastore at ``path``; with ``expect_meta``, refuse one built from something else."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise DatastoreError(f"datastore {path}: no such file")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get("meta", "{}"))
                keys, values = f.get_tensor("keys"), f.get_tensor("values")
        except Exception as exc:  # safetensors raises several types for a malformed file
            raise DatastoreError(f"datastore {path}: not a readable safetensors datastore ({exc})") from None
        if expect_meta is not None and meta != json.loads(json.dumps(expect_meta, sort_keys=True)):
            raise DatastoreError(f"datastore {path}: built from {meta}, expected {expect_meta}; delete it to rebuild")
        return cls(keys, values, meta)
