"""Rollout back ends of RL and OPD (report §5.2.1): the co-located engine, the verifiers
back end over our server, their replicas, evaluation and the weight hand-over.

Import the modules themselves (``megatron_s2.posttrain.rollout.engine_backend`` ...); this
package file exists so the import contracts see them (a folder without one is a namespace
package, invisible to ``lint-imports``).
"""
