"""A model's mapping table and the two drivers that apply it (export and import).

:class:`MappingRegistry` resolves every name of our state to exactly one mapping (an
unmapped or doubly mapped name is an error, never a silent drop) and runs:

* :meth:`MappingRegistry.export_views` — our full state -> Hugging Face tensors, as views of
  the source tensors (nothing is copied until a shard is written); tensors whose import
  fallback reproduces them exactly are elided;
* :meth:`MappingRegistry.import_state` — Hugging Face tensors -> our full state for the names
  and full shapes a model skeleton expects. FP8/FP4 tensors are dequantised with their
  ``.scale`` companions; every source tensor must be consumed, be a consumed scale, or sit
  under a documented skipped prefix — anything else is reported as unknown and refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from megatron_s2.models.family.param_mapping import Bindings, ConversionContext, FusedPartMapping, ParamMapping

__all__ = ["ConversionError", "ImportReport", "MappingRegistry"]


class ConversionError(ValueError):
    """A state that the mapping table cannot convert faithfully."""


@dataclass
class ImportReport:
    tensors_read: int = 0
    dequantized: int = 0
    fallbacks: list[tuple[str, str]] = field(default_factory=list)   # (our name, Hugging Face source)
    skipped: dict[str, int] = field(default_factory=dict)            # skipped prefix -> tensors

    def lines(self) -> list[str]:
        out = [f"read {self.tensors_read} tensors ({self.dequantized} dequantised from FP8/FP4)"]
        for ours, src in self.fallbacks:
            out.append(f"  {ours} <- {src} (exact substitute, see the mapping table)")
        for prefix, n in sorted(self.skipped.items()):
            out.append(f"  skipped {n} tensors under '{prefix}'")
        return out


class MappingRegistry:
    def __init__(self, mappings: list[ParamMapping], skipped_hf_prefixes: Mapping[str, str] | None = None):
        self.mappings = list(mappings)
        self.skipped = dict(skipped_hf_prefixes or {})

    # ---- resolution ------------------------------------------------------------------------
    def resolve(self, name: str) -> tuple[ParamMapping, Bindings]:
        hits = [(m, b) for m in self.mappings if (b := m.match(name)) is not None]
        if not hits:
            raise ConversionError(f"no mapping for '{name}'; add a row to the model's mapping table")
        if len(hits) > 1:
            raise ConversionError(f"'{name}' matches several mappings: {[m.megatron for m, _ in hits]}")
        return hits[0]

    def describe(self) -> str:
        rows = [(m.megatron, m.hf, type(m).__name__.replace("Mapping", "").lower(),
                 "yes" if m.confirmed else "NO", m.note) for m in self.mappings]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"{'ours':<{widths[0]}}  {'hugging face':<{widths[1]}}  {'rule':<{widths[2]}}  confirmed"]
        for r in rows:
            lines.append(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:<9}  {r[4]}".rstrip())
        return "\n".join(lines)

    # ---- export ------------------------------------------------------------------------------
    def export_views(self, state: Mapping[str, torch.Tensor], ctx: ConversionContext
                     ) -> tuple[dict[str, tuple[torch.Tensor, ParamMapping]], list[str]]:
        """({hf name: (view, mapping)}, elided our-names)."""
        views: dict[str, tuple[torch.Tensor, ParamMapping]] = {}
        owners: dict[str, str] = {}
        resolved = {}
        fused: dict[str, dict[int, tuple[torch.Tensor, FusedPartMapping, str]]] = {}
        for name, tensor in state.items():
            mapping, bindings = self.resolve(name)
            resolved[name] = (mapping, bindings)
            for hf_name, view in mapping.to_hf(tensor, bindings, ctx).items():
                if isinstance(mapping, FusedPartMapping):
                    parts = fused.setdefault(hf_name, {})
                    if mapping.part in parts:
                        raise ConversionError(f"'{name}' and '{parts[mapping.part][2]}' both map to part "
                                              f"{mapping.part} of '{hf_name}'")
                    parts[mapping.part] = (view, mapping, name)
                    continue
                if hf_name in views:
                    raise ConversionError(f"'{name}' and '{owners[hf_name]}' both map to '{hf_name}'")
                views[hf_name], owners[hf_name] = (view, mapping), name
        for hf_name, parts in fused.items():  # concatenated once all parts are there (a copy)
            count = len(parts[min(parts)][1].rows(ctx.cfg))
            if sorted(parts) != list(range(count)):
                raise ConversionError(f"'{hf_name}' fuses {count} tensors, the state has parts {sorted(parts)} "
                                      f"({[p[2] for p in parts.values()]})")
            if hf_name in views:
                raise ConversionError(f"'{hf_name}' is both a fused tensor and '{owners[hf_name]}'")
            views[hf_name] = (torch.cat([parts[i][0] for i in range(count)], dim=0), parts[0][1])
        elided = []
        for name, (mapping, bindings) in resolved.items():
            fb = mapping.fallback
            if not (mapping.elide_if_derivable and fb) or fb.applicable(ctx, bindings) is not None:
                continue
            source = views.get(fb.hf.format(**bindings))
            (hf_name,) = mapping.hf_names(bindings, ctx)
            if source is not None and torch.equal(views[hf_name][0], source[0].to(views[hf_name][0].dtype)):
                del views[hf_name]
                elided.append(name)
        return views, elided

    # ---- import ------------------------------------------------------------------------------
    def import_state(self, source, expected: Mapping[str, "object"], ctx: ConversionContext,
                     progress=None) -> tuple[dict[str, torch.Tensor], ImportReport]:
        """Our full state for the ``expected`` names (``name -> TensorInfo`` of a skeleton)."""
        report = ImportReport()
        state: dict[str, torch.Tensor] = {}
        missing: list[str] = []
        for name, info in expected.items():
            mapping, bindings = self.resolve(name)
            names = mapping.hf_names(bindings, ctx)
            absent = [n for n in names if n not in source]
            if absent:
                fb = mapping.fallback
                reason = "no fallback" if fb is None else fb.applicable(ctx, bindings)
                alt = fb.hf.format(**bindings) if fb is not None else None
                if reason is not None or alt not in source:
                    why = reason or f"'{alt}' is absent too"
                    missing.append(f"{name} <- {absent[0]}{' ...' if len(absent) > 1 else ''} ({why})")
                    continue
                tensor = source.get(alt)
                report.fallbacks.append((name, alt))
            else:
                tensor = mapping.from_hf({n: source.get(n) for n in names}, bindings, ctx, info.full_shape)
            if tuple(tensor.shape) != tuple(info.full_shape):
                raise ConversionError(f"{name}: the checkpoint gives shape {tuple(tensor.shape)} "
                                      f"({', '.join(names[:2])}), the config expects {tuple(info.full_shape)}")
            if info.dtype.is_floating_point and not tensor.is_floating_point():
                # casting integer codes to floats would invent weights (int32 ones become 0, 1, 2...)
                raise ConversionError(f"{names[0]}: stored as {str(tensor.dtype).replace('torch.', '')}, but "
                                      f"'{name}' is a {str(info.dtype).replace('torch.', '')} weight; the file is "
                                      "not a checkpoint of this model (or was written wrongly)")
            state[name] = tensor.to(info.dtype)
            if progress is not None:
                progress.update(1)
        if missing:
            raise ConversionError(f"{len(missing)} tensors of the model are not in the checkpoint: "
                                  + "; ".join(missing[:4]) + ("; ..." if len(missing) > 4 else "")
                                  + "; the checkpoint is incomplete or its config.json describes another model")
        unknown = []
        for key in source.reader.keys():
            if key in source.used:
                continue
            prefix = next((p for p in self.skipped if key.startswith(p)), None)
            if prefix is not None:
                report.skipped[prefix] = report.skipped.get(prefix, 0) + 1
            else:
                unknown.append(key)
        if unknown:
            raise ConversionError(f"{len(unknown)} checkpoint tensors map to nothing in this model config, e.g. "
                                  f"{unknown[:6]}; the config.json does not describe these weights")
        report.tensors_read, report.dequantized = len(source.used), source.dequantized
        return state, report
