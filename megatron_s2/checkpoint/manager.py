"""The trainer's checkpoint manager: sharded save (sync or async) and load at any layout.

::

    ckpt = CheckpointManager(run_dir / "checkpoints", rank, world_size, keep_last=3,
                             async_save=False, layout=layout.describe())
    ckpt.save(step, {"model": model, "optimizer": opt, "data": it.state_dict(), "rng": rng_state()},
              {"layout": ..., "config": recipe.to_mapping(), "model": "tiny"})
    path = ckpt.latest_valid()                 # collective; falls back past broken checkpoints
    loaded = ckpt.load(path, model, opt)       # collective; any layout the model was built for
    loaded.step, loaded.data, loaded.rng       # rng is None unless the layout is unchanged
    loaded.local                               # state["local"] of this rank, likewise

Every rank constructs the manager at the same point (it creates the checkpoint process
group) and calls ``save`` / ``load`` / ``latest_valid`` together.

Loading checks, before any tensor is read, that every model tensor of this rank is stored
with the same global shape, that the union of all ranks' requests covers every stored model
(and, when loading it, optimiser) tensor — a layout that would silently drop state is an
error — and that the checkpoint holds optimiser state when asked for it.
"""

from __future__ import annotations

import errno
import platform
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_s2.checkpoint.async_save import BackgroundWriter
from megatron_s2.checkpoint.collectives import (
    agree_on_error,
    barrier,
    checkpoint_group,
    gather_objects,
    gather_to_first,
    group_rank,
)
from megatron_s2.checkpoint.format import (
    DCP_METADATA,
    MANIFEST,
    MODEL_PREFIX,
    OPTIM_PREFIX,
    CheckpointError,
    Manifest,
    sha256_file,
)
from megatron_s2.checkpoint.space import chunk_sizes, committed_size, free_bytes, mib, save_size
from megatron_s2.checkpoint.store import CheckpointStore, is_step_dir, verify_checkpoint
from megatron_s2.runtime.finite import first_non_finite

if TYPE_CHECKING:
    from megatron_s2.checkpoint.dcp_io import GlobalShard

__all__ = ["CheckpointManager", "LoadedCheckpoint"]


@dataclass
class LoadedCheckpoint:
    path: Path
    manifest: Manifest
    rng: dict | None = None
    """This rank's RNG state; None when the layout changed (or none was stored)."""
    local: dict | None = None
    """This rank's ``local`` tensors; None when the layout changed (empty when none were stored)."""
    fresh_optimizer_state: list[str] = field(default_factory=list)
    """Parameters of this rank that had no stored optimiser state."""
    fresh_model: list[str] = field(default_factory=list)
    """Model tensors (under ``may_be_missing``) absent from the checkpoint: they keep their
    initialisation (e.g. a DSpark drafter added to a pre-trained backbone)."""

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def data(self) -> dict | None:
        return self.manifest.data


class CheckpointManager:
    def __init__(self, root: Path, rank: int = 0, world_size: int = 1, *, keep_last: int = 3,
                 async_save: bool = False, layout: str = "", log=print):
        self.rank, self.world_size, self.layout, self.log = rank, world_size, layout, log
        self.store = CheckpointStore(Path(root), keep_last, log)
        self.group = checkpoint_group(world_size)
        self.writer = BackgroundWriter() if async_save else None
        self.last_saved_step: int | None = None

    @property
    def root(self) -> Path:
        return self.store.root

    # ---- save ------------------------------------------------------------------------------
    def save(self, step: int, state: dict, metadata: dict, *, blocking: bool = True) -> Path:
        """Save ``state`` (model, optimizer, data, rng, local: this rank's other tensors) as step
        ``step``; returns the step directory. With ``async_save`` and ``blocking=False`` the write
        continues in the background after a snapshot and the directory appears when it is committed."""
        from megatron_s2.checkpoint.sharded_state import local_shards, model_shards, optimizer_shards, rng_shards

        self.wait()
        background = self.writer is not None and not blocking
        shards = model_shards(state["model"], snapshot=background)
        if state.get("optimizer") is not None:
            shards.update(optimizer_shards(state["optimizer"], snapshot=background))
        if state.get("rng") is not None:
            shards.update(rng_shards(state["rng"], self.rank))
        if state.get("local"):
            shards.update(local_shards(state["local"], self.rank))
        manifest = Manifest(step=step, world_size=self.world_size, layout=metadata.get("layout", self.layout),
                            config=metadata.get("config", {}), data=state.get("data"),
                            has_optimizer=state.get("optimizer") is not None,
                            rng_ranks=self.world_size if state.get("rng") is not None else 0,
                            info={"model": metadata.get("model", ""), "torch": torch.__version__,
                                  "host": platform.node(), "writers": self.world_size})
        self._check_writable(step, shards, manifest)
        self.last_saved_step = step
        if background:
            self.writer.submit(lambda: self._write(step, shards, manifest), f"step {step}")
        else:
            self._write(step, shards, manifest)
        return self.store.step_dir(step)

    def _check_writable(self, step: int, shards: dict[str, GlobalShard], manifest: Manifest) -> None:
        """Collective, before anything is written: no tensor is NaN or infinite (a checkpoint
        is never committed non-finite, so the newest one is always the last good state), and
        the file system has room for what all ranks will write (a full disk is named, not
        discovered as a truncated shard; :mod:`.space`)."""
        bad = first_non_finite((fqn, shard.local) for fqn, shard in shards.items())
        error = f"checkpoint step {step} not written: '{bad}' holds NaN or infinite values" if bad else None
        # Chunk sizes go to rank 0 only (as DCP's own save plans do), not to every rank.
        reports = gather_to_first((error, chunk_sizes(shards)), self.group)
        if self.rank == 0:
            error = next((e for e, _ in reports if e), None) or self._check_space(step, [c for _, c in reports],
                                                                                 manifest)
        _raise(agree_on_error(error, self.group))

    def _check_space(self, step: int, reports: list, manifest: Manifest) -> str | None:
        self.store.remove_leftovers()  # a crashed save's directory may hold the space this one needs
        committed = self.store.committed()
        needed = save_size(reports, committed_size(committed[-1], manifest) if committed else 0)
        free = free_bytes(self.root)
        if free is None or free >= needed:
            return None
        kept = f", lower checkpoint.keep_last (now {self.store.keep_last})" if len(committed) > 1 else ""
        return (f"checkpoint step {step} not written: disk full ({mib(needed)} needed, {mib(free)} free under "
                f"{self.root}); free space{kept} or move the run directory")

    def _write(self, step: int, shards: dict[str, GlobalShard], manifest: Manifest) -> None:
        from megatron_s2.checkpoint.dcp_io import save_shards  # torch.distributed.checkpoint: on use

        error = None
        if self.rank == 0:
            try:
                self.store.prepare(step)
            except OSError as exc:
                error = f"{self.store.tmp_dir(step)}: cannot be created ({exc})"
        _raise(agree_on_error(error, self.group))
        tmp = self.store.tmp_dir(step)
        try:
            save_shards(shards, tmp, self.group, group_rank(self.group))
        except (CheckpointError, OSError) as exc:  # raised on every rank (DCP gathers failures)
            self._discard(step)
            raise CheckpointError(self._explain_write_failure(step, exc)) from None
        mine = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                for p in tmp.glob(f"__{group_rank(self.group)}_*.distcp")}
        reports = gather_objects(mine, self.group)
        error = None
        if self.rank == 0:
            try:
                for report in reports:
                    manifest.files.update(report)
                meta = tmp / DCP_METADATA
                manifest.files[DCP_METADATA] = {"sha256": sha256_file(meta), "bytes": meta.stat().st_size}
                self.store.commit(step, manifest, self.rank)
            except (OSError, CheckpointError) as exc:
                self._discard(step)
                error = f"checkpoint step {step}: commit failed: {self._explain_write_failure(step, exc)}"
        _raise(agree_on_error(error, self.group))

    def _discard(self, step: int) -> None:
        """Rank 0 removes a failed save's partial directory: it can never be loaded, and on a
        full disk it holds the space the next start needs."""
        if self.rank == 0:
            shutil.rmtree(self.store.tmp_dir(step), ignore_errors=True)

    def _explain_write_failure(self, step: int, exc: Exception) -> str:
        """The failure of a save in one line; a full disk (which DCP may also report as a bad
        zip position or a short write) is called by its name, with the checkpoint to resume from."""
        free = free_bytes(self.root)
        if getattr(exc, "errno", None) == errno.ENOSPC or (free is not None and free < (1 << 20)):
            where = f" ({mib(free)} left under {self.root})" if free is not None else ""
            committed = [p for p in self.store.committed() if p.name != self.store.step_dir(step).name]
            resume = (f"resume from {committed[-1].name}, which is intact" if committed else
                      "run again (no checkpoint was committed yet)")
            return f"checkpoint step {step} not written: disk full{where}; free space and {resume}"
        return str(exc)

    def wait(self) -> None:
        """Block until an asynchronous save is committed (re-raising its failure)."""
        if self.writer is not None:
            self.writer.wait()

    # ---- discovery ---------------------------------------------------------------------------
    def latest_valid(self) -> Path | None:
        self.wait()
        return self.store.latest_valid(self.group)

    def resume_path(self) -> Path | None:
        """Where ``train`` resumes: the valid checkpoint ``latest`` names, else the newest
        valid one (saying so); None when nothing was ever committed. Committed checkpoints
        that are all invalid are an error — starting over silently would discard the run."""
        found = self.latest_valid()
        if found is None and self.store.committed():
            raise CheckpointError(f"{self.root}: holds committed checkpoints but none is valid (see the messages "
                                  "above); repair or remove them, or start over with checkpoint.resume=false")
        return found

    def resolve(self, path: Path) -> Path:
        """A step directory as given, or the newest valid checkpoint of a ``checkpoints/`` (or
        run) directory; CheckpointError when there is none. Collective."""
        self.wait()
        path = Path(path)
        if is_step_dir(path):
            return path
        root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        found = CheckpointStore(root, log=self.log).latest_valid(self.group)
        if found is None:
            raise CheckpointError(f"{path}: holds no valid checkpoint (a committed step_* directory)")
        return found

    # ---- load --------------------------------------------------------------------------------
    def load(self, path: Path, model, optimizer=None, *, may_be_missing: tuple[str, ...] = (),
             load_only: tuple[str, ...] = ()) -> LoadedCheckpoint:
        """Fill ``model`` (and ``optimizer``'s state) from the checkpoint at ``path``, whatever
        layout wrote it. Refuses uncommitted, corrupted or incompatible checkpoints.
        ``may_be_missing``: name prefixes of model tensors that may be absent (they keep their
        initialisation; listed in ``fresh_model``). ``load_only``: name prefixes of the only model
        tensors taken (the others keep their initialisation, stored tensors outside them are left
        behind): a phase that keeps part of an earlier phase's model, e.g. its vision encoder."""
        from megatron_s2.checkpoint.dcp_io import load_shards, read_index  # torch.distributed.checkpoint: on use
        from megatron_s2.checkpoint.sharded_state import (
            local_from_tensors,
            local_targets,
            model_shards,
            optimizer_targets,
            rng_from_tensors,
            rng_targets,
        )

        self.wait()
        path = Path(path)
        manifest = verify_checkpoint(path, self.group)
        error, index, targets, opt, fresh = None, None, {}, None, []
        try:
            index = read_index(path)
            targets = model_shards(model)
            fresh = sorted(fqn for fqn in targets if fqn not in index.state_dict_metadata
                           and fqn[len(MODEL_PREFIX):].startswith(may_be_missing)) if may_be_missing else []
            if load_only:  # the rest of the model keeps its initialisation
                fresh = sorted(set(fresh) | {fqn for fqn in targets if not fqn[len(MODEL_PREFIX):].startswith(load_only)})
            for fqn in fresh:
                del targets[fqn]
            error = _check_model(targets, index, path)
            if optimizer is not None and not manifest.has_optimizer:
                error = error or (f"{path / MANIFEST}: holds no optimizer state; load the model only "
                                  "(checkpoint.load_optimizer=false)")
            if optimizer is not None and error is None:
                opt = optimizer_targets(optimizer, index)
        except CheckpointError as exc:
            error = str(exc)
        _raise(agree_on_error(error, self.group))
        requested = set(targets) | (set(opt.shards) if opt else set())
        if load_only and index is not None:  # stored model tensors outside load_only are left behind
            requested |= {k for k in index.state_dict_metadata
                          if k.startswith(MODEL_PREFIX) and not k[len(MODEL_PREFIX):].startswith(load_only)}
        _raise(self._uncovered(index, requested, optimizer is not None, path))  # same result on every rank
        same_layout = (manifest.layout == self.layout and manifest.world_size == self.world_size
                       and manifest.rng_ranks == self.world_size)
        rng = rng_targets(index, self.rank) if same_layout else {}
        local = local_targets(index, self.rank) if same_layout else {}
        load_shards({**targets, **(opt.shards if opt else {}), **rng, **local}, path, self.group)
        if opt:
            opt.apply()
        barrier(self.group)
        return LoadedCheckpoint(path, manifest, rng=rng_from_tensors(rng) if rng else None,
                                fresh_optimizer_state=opt.fresh if opt else [],
                                fresh_model=[fqn[len(MODEL_PREFIX):] for fqn in fresh],
                                local=local_from_tensors(local, self.rank) if same_layout else None)

    def _uncovered(self, index, requested: set[str], with_optimizer: bool, path: Path) -> str | None:
        """Stored tensors no rank asked for (a layout that would silently drop state): one
        bit per stored key, OR-reduced over ranks, so the cost does not grow with the world."""
        prefixes = (MODEL_PREFIX, OPTIM_PREFIX) if with_optimizer else (MODEL_PREFIX,)
        keys = sorted(k for k in index.state_dict_metadata if k.startswith(prefixes))
        asked = torch.tensor([k in requested for k in keys], dtype=torch.uint8, device="cpu")  # gloo group
        if self.group is not None and keys:
            dist.all_reduce(asked, op=dist.ReduceOp.MAX, group=self.group)
        missed = [k for k, bit in zip(keys, asked.tolist()) if not bit]
        model = [k for k in missed if k.startswith(MODEL_PREFIX)]
        if model:
            return (f"{path}: {len(model)} stored tensors have no place in this model/layout "
                    f"(e.g. {', '.join(model[:3])}); the checkpoint is for a different model")
        if missed:
            return (f"{path}: {len(missed)} stored optimizer state tensors belong to no parameter this run updates "
                    f"(e.g. {', '.join(missed[:3])}): frozen parameters or changed optimiser rules; "
                    "load without optimizer state (checkpoint.load_optimizer=false)")
        return None


def _check_model(targets: dict[str, GlobalShard], index, path: Path) -> str | None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = index.state_dict_metadata
    for fqn, shard in targets.items():
        md = stored.get(fqn)
        if md is None:
            return (f"{path}: has no tensor '{fqn[len(MODEL_PREFIX):]}', which this model has; "
                    "the checkpoint is for a different model")
        if not isinstance(md, TensorStorageMetadata):
            return f"{path}: '{fqn}' is stored as a pickled object, not a tensor; refused"
        if tuple(md.size) != tuple(shard.global_shape):
            return (f"{path}: '{fqn[len(MODEL_PREFIX):]}' is stored with global shape {tuple(md.size)}, "
                    f"this model's is {tuple(shard.global_shape)}")
    return None


def _raise(error: str | None) -> None:
    if error:
        raise CheckpointError(error)
