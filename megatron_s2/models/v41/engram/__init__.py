"""Engram conditional memory (report §2.4.2) with row-partitioned tables (§3.1.3).

* :mod:`.hashing` -- deterministic multi-head N-gram hashing (``EngramHasher``);
* :mod:`.table` -- the table partitioned over the engram-parallel group, its distributed
  lookup and FP8 rows (``EngramTable``);
* :mod:`.module` -- the gated residual-stream update of one hosting layer (``Engram``);
* :mod:`.prefetch` -- the rows of a whole training step fetched at once, their gradients
  returned after the backbone backward (``EngramPrefetch``).
"""

from megatron_s2.models.v41.engram.hashing import EngramHasher, engram_primes, hash_multipliers, is_prime
from megatron_s2.models.v41.engram.module import Engram, engram_gate
from megatron_s2.models.v41.engram.prefetch import EngramPrefetch
from megatron_s2.models.v41.engram.table import ENGRAM_ROW_ALIGN, EngramTable, distributed_lookup, fake_quant_rows

__all__ = ["ENGRAM_ROW_ALIGN", "Engram", "EngramHasher", "EngramPrefetch", "EngramTable", "distributed_lookup", "engram_gate",
           "engram_primes", "fake_quant_rows", "hash_multipliers", "is_prime"]
