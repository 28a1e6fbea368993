"""Disaggregated asynchronous RL (``rl.mode: disaggregated``; issue 25, the Prime Intellect talk, seed 004).

Three roles, three kinds of process, each only consuming what another produces:

==================  ===========================================  ==========================================
role                consumes                                     produces
==================  ===========================================  ==========================================
inference servers   generation requests; published weights       tokens, log-probs, per-token versions
(``serve``)         (``POST /update_weights``)                   (``/inference/v1/generate``)
orchestrator        the servers' samples; the trainer's          batch files (token ids, log-probs,
(:mod:`.orchestrator_role`)  newest published version           versions, rewards), one per step
trainer             batch files, in step order                   weights, one checkpoint per version
(:mod:`.trainer`)
==================  ===========================================  ==========================================

The queues are files in ``<run>/disaggregated/`` (:mod:`.exchange`): batches are written whole
and renamed into place, weights are committed checkpoints. Files, not sockets, because they
survive the death of either side — a trainer killed -9 resumes from its checkpoint and re-reads
the same batch files (no sample lost or trained twice), an orchestrator restarts from the state
stored in its last batch — and because a SLURM job's roles share the run directory anyway.
Generation goes over HTTP, so a dead server's requests are re-routed to the others
(:mod:`.served_backend`). Verifiers environments are played by the orchestrator against the servers
as verifiers plays any model (:mod:`.served_verifiers`); agentic environments' harnesses and
sandboxes run in the orchestrator against its own agent gateway, whose model calls go to the
servers (:mod:`.served_agentic`); held-out evaluation runs in the trainer
through the same servers right after it publishes the evaluated version (:mod:`.served_eval`).
With ``weight_sync: broadcast`` the trainer also sends each version to the live servers over a
process group formed for the update (:mod:`.weight_sync`), the checkpoint being the fallback.
"""
