"""verifiers plugin id ``megatron_s2_retry``: the embedded verifiable tasks with a second try after
feedback — a multi-turn taskset (rubric: 1 / the try that first verifies) and its harness
(megatron_s2/posttrain/envs/vf_retry.py). Put this folder on ``sys.path``
(``megatron_s2.posttrain.envs.vf_tasks.plugin_dir()``)."""

from megatron_s2.posttrain.envs.vf_retry import RetryHarness, RetryTaskset

__all__ = ["RetryTaskset", "RetryHarness"]
