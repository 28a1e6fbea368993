"""Deterministic multi-head N-gram hashing of Engram (report §2.4.2, §3.1.3).

Engram addresses its tables by hashing the N-gram that ends at each position: "Engram lookup
indices depend solely on the input token sequence" (§3.1.3), which is what allows the rows to
be prefetched before a pipeline stage runs. The rules follow the public DeepSeek-V4.1-Flash
inference code (``NgramHashState``) so that released tables are addressed identically:

1. Token ids go through the tokenizer's *compressed token map* (tokens that normalise alike
   share an id; identity when no map is given). The compressed vocabulary size is
   ``max(map) + 1``.
2. For shift ``k = 0 .. N-1`` the token ``k`` positions back is used, replaced by the
   compressed pad id when it lies before the sequence start, before the start of the current
   document (``doc_ids``), or at/behind a dead token (an image-span token; shift 0 included).
   Once blocked, every further shift is blocked too.
3. Each (layer, shift) has one odd int64 multiplier drawn from
   ``numpy.random.default_rng(10007 * layer_id)`` below ``(int64_max // compressed_vocab) // 2``,
   times 2 plus 1, so ``token * multiplier`` never overflows.
4. ``rolling_k = XOR_{j <= k} token_j * multiplier_j``; the (k+1)-gram of hash head ``h``
   maps to ``rolling_k % prime[order][h] + offset[order][h]``, a row of the layer's
   concatenated table.
5. Table sizes are distinct primes: for each Engram layer in order, each order, each head,
   the next prime above ``engram_table_size - 1`` (restarting per order) not used before.
"""

from __future__ import annotations

from itertools import accumulate

import numpy as np
import torch

from megatron_s2.models.v41.config import V41Config

__all__ = ["EngramHasher", "engram_primes", "hash_multipliers", "is_prime", "next_unused_prime"]

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic below 3.3e24


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin, exact for every n < 2^64 (and far beyond)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_unused_prime(start: int, used: set[int]) -> int:
    """The smallest prime strictly above ``start`` that is not in ``used``."""
    c = start + 1
    while c in used or not is_prime(c):
        c += 1
    return c


def engram_primes(num_layers: int, num_orders: int, num_heads: int,
                  table_size: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Table sizes ``[engram layer][order][head]``, all distinct primes (rule 5)."""
    used: set[int] = set()
    out = []
    for _ in range(num_layers):
        per_order = []
        for _ in range(num_orders):
            current, heads = table_size - 1, []
            for _ in range(num_heads):
                current = next_unused_prime(current, used)
                used.add(current)
                heads.append(current)
            per_order.append(tuple(heads))
        out.append(tuple(per_order))
    return tuple(out)


def hash_multipliers(layer_id: int, max_ngram: int, compressed_vocab: int) -> tuple[int, ...]:
    """One odd multiplier per shift 0..max_ngram-1 of model layer ``layer_id`` (rule 3)."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    values = np.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram,), dtype=np.int64)
    return tuple(int(v) * 2 + 1 for v in values)


def _shift(x: torch.Tensor, k: int, fill) -> torch.Tensor:
    """``out[:, p] = x[:, p - k]``, ``fill`` where ``p < k``."""
    if k == 0:
        return x
    out = torch.full_like(x, fill)
    if k < x.size(1):
        out[:, k:] = x[:, :-k]
    return out


class EngramHasher:
    """Hash ids of every Engram layer of a model; pure and deterministic (module docstring).

    ``hasher(input_ids, layer_id, doc_ids=None, dead=None)`` maps ``[b, s]`` token ids to
    ``[b, s, num_orders * num_heads]`` int64 rows of that layer's concatenated table, columns
    ordered (order, head) with the order slowest.
    """

    def __init__(self, *, layer_ids: tuple[int, ...], ngram_orders: tuple[int, ...], num_heads: int,
                 table_size: int, pad_id: int, vocab_size: int, compressed_token_map: list[int] | None = None):
        orders = tuple(ngram_orders)
        if orders != tuple(range(2, 2 + len(orders))) or not orders:
            raise ValueError(f"ngram_orders: must be the contiguous orders 2..N, got {list(orders)}")
        if compressed_token_map is None:
            token_map = torch.arange(vocab_size, dtype=torch.int64, device="cpu")  # host copy; per-device cache below
        else:
            token_map = torch.as_tensor(list(compressed_token_map), dtype=torch.int64, device="cpu")
            if token_map.numel() < vocab_size or int(token_map.min()) < 0:
                raise ValueError(f"compressed_token_map: needs a non-negative id for each of the {vocab_size} "
                                 f"tokens, got {token_map.numel()} entries (min {int(token_map.min())})")
        if not 0 <= pad_id < token_map.numel():
            raise ValueError(f"pad_id: {pad_id} is not a token id of the compressed token map")
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.num_orders, self.num_heads, self.max_ngram = len(orders), num_heads, max(orders)
        self.compressed_vocab = int(token_map.max()) + 1
        self.pad_id = int(token_map[pad_id])
        self.primes = engram_primes(len(self.layer_ids), self.num_orders, num_heads, table_size)
        self.multipliers = {lid: hash_multipliers(lid, self.max_ngram, self.compressed_vocab) for lid in self.layer_ids}
        self._token_map = token_map
        self._device_cache: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}

    @classmethod
    def from_config(cls, config: V41Config, compressed_token_map: list[int] | None = None) -> EngramHasher:
        return cls(layer_ids=config.engram_layers, ngram_orders=config.engram_ngram_orders,
                   num_heads=config.engram_num_heads, table_size=config.engram_table_size,
                   pad_id=config.engram_pad_id, vocab_size=config.vocab_size,
                   compressed_token_map=compressed_token_map)

    # ---- table geometry ----------------------------------------------------------------
    def _index(self, layer_id: int) -> int:
        if layer_id not in self.layer_ids:
            raise ValueError(f"layer {layer_id} hosts no Engram module (Engram layers: {list(self.layer_ids)})")
        return self.layer_ids.index(layer_id)

    def table_sizes(self, layer_id: int) -> tuple[int, ...]:
        """Prime size of each (order, head) table of the layer, in column order."""
        return tuple(p for per_order in self.primes[self._index(layer_id)] for p in per_order)

    def table_offsets(self, layer_id: int) -> tuple[int, ...]:
        """First row of each (order, head) table inside the layer's concatenated table."""
        return tuple(accumulate(self.table_sizes(layer_id)[:-1], initial=0))

    def num_rows(self, layer_id: int) -> int:
        return sum(self.table_sizes(layer_id))

    # ---- hashing -----------------------------------------------------------------------
    def _constants(self, layer_id: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        key = (layer_id, device)
        if key not in self._device_cache:
            idx = self._index(layer_id)
            primes = torch.tensor(self.primes[idx], dtype=torch.int64, device=device)  # [orders, heads]
            offsets = torch.tensor(self.table_offsets(layer_id), dtype=torch.int64, device=device)
            self._device_cache[key] = (self._token_map.to(device), primes, offsets.view_as(primes))
        return self._device_cache[key]

    def __call__(self, input_ids: torch.Tensor, layer_id: int, doc_ids: torch.Tensor | None = None,
                 dead: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        token_map, primes, offsets = self._constants(layer_id, input_ids.device)
        mult = self.multipliers[layer_id]
        tokens = token_map[input_ids.long()]
        dead = torch.zeros_like(tokens, dtype=torch.bool) if dead is None else dead.bool()
        blocked = torch.zeros_like(dead)
        rolling, hashes = None, []
        for k in range(self.max_ngram):
            blocked = blocked | _shift(dead, k, True)  # before the sequence start or a dead token
            if doc_ids is not None and k > 0:
                blocked = blocked | (_shift(doc_ids, k, -1) != doc_ids)
            product = torch.where(blocked, self.pad_id, _shift(tokens, k, self.pad_id)) * mult[k]
            rolling = product if rolling is None else torch.bitwise_xor(rolling, product)
            if k > 0:  # the (k+1)-gram, one column per head
                hashes.append(rolling.unsqueeze(-1) % primes[k - 1] + offsets[k - 1])
        return torch.cat(hashes, dim=-1)
