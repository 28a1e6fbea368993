"""verifiers plugin id ``megatron_s2_tasks``: the embedded verifiable tasks as a verifiers v1
taskset (rubric: the task's exact verifier) with a one-call harness
(megatron_s2/posttrain/envs/vf_tasks.py). Put this folder on ``sys.path``
(``megatron_s2.posttrain.envs.vf_tasks.plugin_dir()``)."""

from megatron_s2.posttrain.envs.vf_tasks import AskOnceHarness, EmbeddedTaskset

__all__ = ["EmbeddedTaskset", "AskOnceHarness"]
