"""Post-training: asynchronous RL and on-policy distillation (issue 14), engine-independent part.

An algorithm is a composition — where rollouts come from x what the advantage is x the
(shared) loss — chosen in YAML (``rl:`` / ``opd:`` sections, :mod:`.config`), not a class per
paper. Map of the package:

=====================================  ========================================================
walkthrough / report                   module
=====================================  ========================================================
Eq. 27 leave-one-out, GRPO mean        ``advantages/group.py`` (+ DAPO dynamic sampling)
Eq. 25-26 GEPO                         ``advantages/gepo.py``
Eq. 14-17 adaptive length reg.         ``advantages/length.py``
report Eq. 8-10, Table 2 (effort)      ``advantages/effort.py``
Eq. 30 process-weighted session credit ``advantages/session_credit.py``
Eq. 28 composition order               ``advantages/pipeline.py``
Eq. 10-11 truncated detached IS        ``losses/importance.py``
Eq. 12-13 BKL mask, report §5.2.2      ``losses/masks.py`` (BKL, binary TV, staleness)
Eq. 29 token-level PG loss, KL ref     ``losses/terms.py``, ``losses/aggregation.py``,
                                       ``losses/objective.py`` (registry composition)
vocabulary-parallel log-prob/entropy/  ``vocab_parallel.py``
KL/TV on [b, s, V/tp] logit shards
Eq. 31-36 sampled-token OPD            ``opd/sampled_token.py``
report §5.2.4 full-vocabulary OPD      ``opd/full_vocab.py``
report §5.2.1-5.2.3 orchestration      ``orchestrator/`` (backend protocol, dispatch,
                                       staleness, warm-up discard, crash-safe state)
report §5.2.1 concatenated R3          ``routing.py``
Ch. 6 token-in/token-out sessions      ``multiturn.py``
training micro-batch tensors           ``batch.py``
=====================================  ========================================================
"""
