"""Model families that live in the test suite: proof that generic code reaches a family only
through ``model.family`` and :mod:`megatron_s2.models.family` (no line of ``megatron_s2``
names them)."""
