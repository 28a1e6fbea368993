"""Measured memory of one training step on any device, CPU included.

CUDA has ``max_memory_allocated``; CPU has nothing comparable, so :class:`AllocationTracker`
measures allocations itself: a ``TorchDispatchMode`` sees every operator (forward, backward,
collectives), records each output whose storage is new — not an alias of an input — and
watches the storage's lifetime through a weak reference to its Python object (PyTorch keeps
that object alive exactly as long as the storage, also while autograd holds it for backward).
The result is a timeline of (allocated / freed, bytes, storage) events and its peak.

:func:`measure_step` runs one real optimiser step of a :class:`~megatron_s2.training.trainer.Trainer`
and returns what the planner estimates:

* parameters (including pipeline shadow replicas), gradients at their peak (every parameter
  that received one during the backward: ZeRO-1 frees non-owned ones only after the
  reduce-scatter), optimiser state after the step — counted from the live tensors, so a
  planner estimate must match them exactly;
* the activation peak of the forward/backward (every tensor allocated during it, minus the
  parameter gradients that are still alive at its end, which the planner counts as
  gradients): saved activations, transients, pipeline payload buffers and communication
  buffers alike.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["AllocationTracker", "SavedTensorTracker", "MeasuredStep", "measure_step", "tensor_bytes"]


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among ``tensors``."""
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


class AllocationTracker(TorchDispatchMode):
    """Live bytes of storages allocated while the mode is active (see module docstring)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[int, int]] = []  # (+/- bytes, storage id)
        self.live: dict[int, tuple[int, int]] = {}  # StorageImpl address -> (id, bytes)
        self._refs: dict[int, weakref.ref] = {}
        self._ids = itertools.count()

    def _freed(self, address: int) -> None:
        sid, nbytes = self.live.pop(address, (None, 0))
        self._refs.pop(address, None)
        if sid is not None:
            self.events.append((-nbytes, sid))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            address = st._cdata
            if address in inputs or address in self.live or st.nbytes() == 0:
                continue
            sid = next(self._ids)
            self.live[address] = (sid, st.nbytes())
            self._refs[address] = weakref.ref(st, lambda _, a=address: self._freed(a))
            self.events.append((st.nbytes(), sid))
        return out

    def ids_of(self, tensors) -> set[int]:
        """Tracker ids of the (still live) storages of ``tensors``."""
        return {self.live[t.untyped_storage()._cdata][0] for t in tensors
                if t is not None and t.untyped_storage()._cdata in self.live}

    def peak(self, exclude: set[int] = frozenset()) -> int:
        current = best = 0
        for delta, sid in self.events:
            if sid in exclude:
                continue
            current += delta
            best = max(best, current)
        return best


class SavedTensorTracker:
    """Live bytes of the storages autograd holds for backward (saved activations).

    ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor an operator saves; each
    distinct storage (parameters excluded) is counted from its first save until autograd
    releases it. Cheap enough for every step; :class:`AllocationTracker` also sees transients.
    """

    def __init__(self, exclude_storages=()):
        self.exclude = {t.untyped_storage()._cdata for t in exclude_storages}
        self.current = self.peak = 0
        self.live: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _freed(self, address: int) -> None:
        self.current -= self.live.pop(address, 0)
        self._refs.pop(address, None)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        address = st._cdata
        if address not in self.exclude and address not in self.live and t.device.type != "meta":
            self.live[address] = st.nbytes()
            self._refs[address] = weakref.ref(st, lambda _, a=address: self._freed(a))
            self.current += st.nbytes()
            self.peak = max(self.peak, self.current)
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


@dataclass
class MeasuredStep:
    parameters: int
    gradients: int
    optimizer: int
    saved_activation_peak: int
    """Peak bytes held by autograd for backward during the forward/backward."""
    loss: float
    allocation_peak: int | None = None
    """Peak of all allocations of the forward/backward minus surviving parameter gradients
    (``track_allocations=True`` only: every operator then goes through Python)."""

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def _optimizer_state_tensors(optimizer):
    inner = getattr(optimizer, "inner", optimizer)
    for opt in inner.optimizers.values():
        for state in opt.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    yield value


def _replica_params(pipeline) -> list[torch.nn.Parameter]:
    if pipeline is None:
        return []
    return pipeline.payloads.replica_parameters()


def measure_step(trainer, *, track_allocations: bool = False) -> MeasuredStep:
    """One optimiser step of ``trainer`` with its memory measured (rank-local)."""
    import contextlib

    trainer.schedule.apply(trainer.optimizer, trainer.step)
    micro_batches = trainer.data.next_step()
    params = list(trainer.model.parameters()) + _replica_params(trainer.pipeline)
    allocations = AllocationTracker() if track_allocations else contextlib.nullcontext()
    received: dict[int, int] = {}  # model parameters that got a gradient -> its bytes (replicas hand theirs on)
    hooks = [p.register_post_accumulate_grad_hook(
        lambda q: received.__setitem__(id(q), q.grad.numel() * q.grad.element_size()))
        for p in trainer.model.parameters() if p.requires_grad]
    try:
        with SavedTensorTracker(params) as saved, allocations:
            result = trainer.compute_gradients(micro_batches)
    finally:
        for h in hooks:
            h.remove()
    grads = [p.grad for p in params if p.grad is not None]
    peak = allocations.peak(exclude=allocations.ids_of(grads)) if track_allocations else None
    gradients = sum(received.values())
    trainer.apply_gradients()
    return MeasuredStep(parameters=tensor_bytes(params), gradients=gradients,
                        optimizer=tensor_bytes(list(_optimizer_state_tensors(trainer.optimizer))),
                        saved_activation_peak=saved.peak, loss=result.loss, allocation_peak=peak)
