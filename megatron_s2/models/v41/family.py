"""The V4.1-Flash-style backbone as a model family (``model.family: v41``, the default).

Everything generic code needs of this family, and nothing more: the model of a rank
(:class:`~megatron_s2.models.v41.model.V41Model`), the CSA2 payloads of its pipeline cuts
(§3.1.2), the DeepSeek-V4.1-Flash Hugging Face layout, ``megatron-s2 account`` and the memory
plan's per-layer terms, and the inference engine's cache kinds (§3.2). See
:mod:`megatron_s2.models.family.base` for the contract.
"""

from __future__ import annotations

from megatron_s2.models.family.base import AccountReport, MemoryModel, ModelFamily, RankShape
from megatron_s2.models.v41.config import V41Config

__all__ = ["V41Family", "V41MemoryModel", "FAMILY"]


class V41MemoryModel(MemoryModel):
    """The per-layer terms of ``megatron-s2 plan memory`` (:mod:`megatron_s2.models.v41.activations`)."""

    def __init__(self, cfg: V41Config):
        self.cfg = cfg

    def layer_activations(self, layer: int, shape: RankShape, recompute: str):
        from megatron_s2.models.v41.activations import layer_activations

        return layer_activations(self.cfg, self.cfg.plan[layer], shape, recompute)

    def head_activations(self, shape: RankShape) -> float:
        from megatron_s2.models.v41.activations import head_activations

        return head_activations(self.cfg, shape)

    def transient_bytes(self, shape: RankShape, last_stage: bool) -> float:
        from megatron_s2.models.v41.activations import transient_bytes

        return transient_bytes(self.cfg, shape, last_stage)

    def payload_bytes(self, layout, stage: int, shape: RankShape, parallel) -> float:
        """Inbound shared states (beyond the streams) + the whole outbound payload of ``stage``."""
        from megatron_s2.models.v41.pipeline.payload import PayloadModes, PayloadSpec

        cfg, modes = self.cfg, PayloadModes(parallel.payload_index_k, parallel.payload_candidates)
        local, stream = int(shape.tokens // shape.batch), int(shape.stream_tokens // shape.batch)

        def spec(cut_stage: int) -> PayloadSpec:
            return PayloadSpec.build(cfg, cfg.plan, layout.stage_layers[cut_stage][0], modes, batch=shape.batch,
                                     local_seq=local, full_seq=shape.seq, stream_seq=stream, tp_size=shape.tp)

        total = 0.0
        if stage > 0:
            total += spec(stage).state_bytes()
        if stage < len(layout.stage_layers) - 1:
            total += spec(stage + 1).nbytes
        return total

    def comm_volume(self, recipe, layout, pp_rank: int, grad_bytes: float, expert_grad_bytes: float = 0.0):
        from megatron_s2.models.v41.comm import comm_volume

        return comm_volume(recipe, layout, pp_rank, grad_bytes, expert_grad_bytes)

    def shadow_parameters(self, layout, rank: int, parallel):
        """(meta parameter, receives gradients) of the shadow replicas ``rank`` holds (§3.1.2)."""
        if layout.pp == 1:
            return []
        from megatron_s2.models.family.skeleton import SkeletonMode
        from megatron_s2.models.v41.attention.indexer import IndexKeyProjection, Indexer
        from megatron_s2.models.v41.pipeline.payload import PayloadModes, payload_keys
        from megatron_s2.models.v41.pipeline.shadows import shadow_components
        from megatron_s2.parallel.offline_groups import layout_groups, pp_rank_of

        cfg, modes = self.cfg, PayloadModes(parallel.payload_index_k, parallel.payload_candidates)
        pp_rank, groups = pp_rank_of(layout, rank), layout_groups(layout, rank)
        comps = shadow_components(cfg.plan, layout.stage_layers, lambda s: s % layout.pp,
                                  lambda cut: payload_keys(cfg.plan, cut, modes))
        out = []
        with SkeletonMode():
            for c in comps:
                if pp_rank in c.holders and pp_rank != c.owner_pp:
                    module = IndexKeyProjection(cfg, groups.tp) if c.kind == "index_key" else Indexer(cfg, groups.tp)
                    out += [(p, c.grads) for p in module.parameters()]
        return out


class V41Family(ModelFamily):
    name = "v41"
    config_class = V41Config

    def build_model(self, cfg: V41Config, groups=None, *, layers=None, pre_process: bool = True,
                    post_process: bool = True, portable: bool = False):
        from megatron_s2.models.v41.model import V41Model
        from megatron_s2.models.v41.spec import LocalProvider

        # portable: the local leaf modules; the Transformer Engine ones adopt exactly the same
        # parameters and buffers, so names and shapes agree and no TE is needed to plan or convert.
        return V41Model(cfg, groups, layers=layers, pre_process=pre_process, post_process=post_process,
                        provider=LocalProvider() if portable else None)

    def stage_payloads(self, model, layout, groups, pp_rank: int, parallel):
        from megatron_s2.models.v41.pipeline.payload import PayloadModes
        from megatron_s2.models.v41.pipeline.stage import V41StagePayloads

        modes = PayloadModes(parallel.payload_index_k, parallel.payload_candidates)
        return V41StagePayloads(model, layout, groups, pp_rank, modes)

    def build_contrastive_model(self, cfg: V41Config, contrastive, vocab_size: int, groups=None):
        from megatron_s2.models.v41.vision.contrastive import ContrastiveModel

        return ContrastiveModel(cfg, contrastive, vocab_size, groups)

    def check_recipe(self, recipe) -> None:
        if recipe.model.transformer_impl == "transformer_engine":
            from megatron_s2.models.v41.spec import get_provider

            get_provider("transformer_engine")  # BackendUnavailable is a ConfigError naming the field and fix

    def image_processor(self, cfg: V41Config):
        if not cfg.vision_n_layers:
            return None
        from megatron_s2.models.v41.vision.processor import V41ImageProcessor

        return V41ImageProcessor(cfg)

    def vision_encoder_patterns(self, cfg: V41Config) -> tuple[str, ...]:
        # §2.5: frozen until the decay "while its final normalization layer and the vision-language
        # projector remain trainable" (vision.tower.norm, vision.aligner, the span embeddings)
        return ("vision.tower.patch_embed.*", "vision.tower.blocks.*") if cfg.vision_n_layers else ()

    def describe(self, model, cfg: V41Config) -> list[str]:
        from megatron_s2.models.v41.precision import describe_fp8, describe_precision

        lines = [describe_precision(cfg.params_dtype, cfg.compute_dtype)]
        fp8 = describe_fp8(model, cfg.fp8, cfg.transformer_impl, cfg.compute_dtype)
        return lines + ([fp8] if fp8 else [])

    # ---- accounting ----------------------------------------------------------------------
    def account(self, cfg: V41Config) -> AccountReport:
        from megatron_s2.models.v41.accounting import account, report_lines

        figures = account(cfg)
        return AccountReport(figures, report_lines(figures))

    def train_flops_per_token(self, cfg: V41Config, seq_length: int) -> float:
        from megatron_s2.models.v41.accounting import train_flops_per_token

        return train_flops_per_token(cfg, seq_length)

    def memory_model(self, cfg: V41Config) -> V41MemoryModel:
        return V41MemoryModel(cfg)

    # ---- checkpoints and inference ---------------------------------------------------------
    @property
    def hf(self):
        from megatron_s2.models.v41.hf.adapter import V41HFAdapter

        return V41HFAdapter()

    def executor(self, model, config, device):
        from megatron_s2.models.v41.inference.executor import V41Executor

        return V41Executor(model, config, device)

    def check_engine(self, cfg: V41Config, config) -> None:
        from megatron_s2.models.v41.inference.executor import check_engine_config

        check_engine_config(config, cfg)  # pages of whole compressed blocks; decoder bounded replay

    def engine_cache_bytes(self, cfg: V41Config, config) -> int:
        from megatron_s2.models.v41.accounting import kv_cache_bytes

        return kv_cache_bytes(cfg, config)


FAMILY = V41Family()
