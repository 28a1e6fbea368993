"""On-policy distillation: sampled-token (walkthrough Eq. 31-36; teachers in process or remote) and
full-vocabulary (report §5.2.4)."""

from megatron_s2.posttrain.opd.full_vocab import TeacherPool
from megatron_s2.posttrain.opd.remote_teacher import RemoteTeacher, RemoteTeacherError
from megatron_s2.posttrain.opd.sampled_token import domain_token_weights, opd_advantages

__all__ = ["TeacherPool", "RemoteTeacher", "RemoteTeacherError", "domain_token_weights", "opd_advantages"]
