"""The Memory Decoder's training phases and fused scoring (Intern-S2 walkthrough Ch. 2).

* ``phase.kind: memdec`` — memory-decoder pre-training: the datastore is built once from the
  frozen backbone over the domain corpus (:mod:`.datastore`, cached as safetensors in the run
  directory), then the small decoder of ``model:`` trains on the same corpus with Eq. (2)
  against each position's kNN distribution (:mod:`.objectives`).
* ``phase.kind: memdec_router`` — router training: backbone and memory frozen, the router alone
  trains with Eq. (4) on the domain corpus and a general one, mixed 1:1.
* :mod:`.fusion` — loading the trained attachment (memory + router) next to a backbone and
  scoring text with the fused distribution of Eq. (3) (evaluation, bench/memory_decoder.py).

The mathematics lives in :mod:`megatron_s2.models.memory_decoder`; both models are reached
through the family interface, so either family can be the backbone or the memory. Both phases run
under dp, tp (+ sequence parallelism), pp and ep; cp and etp are refused (:mod:`.trainer`, layouts).
"""
