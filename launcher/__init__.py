"""The launcher: run a recipe locally or on SLURM, and the rank-side pieces the trainer uses.

Submit side (`megatron-s2 launch`, :mod:`.cli`): :mod:`.launch` resolves the recipe or
pipeline (:mod:`.pipeline`), validates the rank geometry and layout before anything starts
(:mod:`.preflight`), writes the job directory (:mod:`.job`) and either starts one process per
rank here (:mod:`.local`) or writes and submits a batch script (:mod:`.sbatch_script`,
:mod:`.slurm`).

Rank side (called by the trainer): :func:`.bootstrap.init_distributed` (rank discovery in
:mod:`.rendezvous`), :class:`.preemption.PreemptionGuard` and
:func:`.health.maybe_run_health_checks`.
"""
