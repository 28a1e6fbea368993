"""Planning before booking a cluster (issue 7, "Planning tools"): memory, layouts, schedule.

* :mod:`.model_state` — parameters, gradients, optimiser state of a rank, counted on a model
  skeleton of the layout (exact: rule table, ZeRO-1 ownership, frozen parameters, shadows);
* the family's ``memory_model`` (V4.1: ``models/v41/activations.py``, ``models/v41/comm.py``) —
  saved activations of one micro-batch per layer and component, the LM head, transients,
  pipeline messages and communication volume;
* :mod:`.schedule` — in-flight micro-batches and the unit-time timeline of the runtime's
  ``schedule_order``; :mod:`.schedule_svg` — its picture;
* :mod:`.memory` — the per-rank plan of a recipe and its most loaded pipeline stage;
* :mod:`.posttrain` — RL / OPD: the co-located rollout copy, engines' KV pages and frozen models;
* :mod:`.layouts` — the ranked layouts of a cluster size;
* :mod:`.measure` — the measured counterpart on any device (CPU included), used by the tests.

The command line is ``megatron-s2 plan memory|layouts|schedule`` (``tools/plan.py``).
"""
