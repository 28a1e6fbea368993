"""CheckpointManager on one process: optimiser state round trip, incompatible checkpoints
refused before any tensor is read, retention, and a checkpoint directory replaced in place."""

from __future__ import annotations

import pytest
import torch

from megatron_s2.checkpoint import CheckpointError, CheckpointManager
from megatron_s2.optim.hybrid import HybridOptimizer
from megatron_s2.parallel.sharding import mark_param

META = {"layout": "test", "config": {}}


class Tiny(torch.nn.Module):
    def __init__(self, width: int = 4, extra: bool = False):
        super().__init__()
        self.proj = torch.nn.Linear(width, 3)
        self.register_buffer("bias_stat", torch.arange(3.0))
        if extra:
            self.gate = torch.nn.Parameter(torch.ones(2))


def _optimizer(model: torch.nn.Module, kind: str = "adamw") -> HybridOptimizer:
    named = list(model.named_parameters())
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.SGD
    opt = cls([{"params": named, "lr": 0.1, "lr_mult": 1.0}], lr=0.1, **({"momentum": 0.9} if kind == "sgd" else {}))
    return HybridOptimizer({kind: opt})


def _step(model, opt) -> None:
    opt.set_lr(0.1)
    model.proj(torch.ones(2, model.proj.in_features)).sum().backward()
    opt.step()
    opt.zero_grad()


def _save(mgr, step, model, opt=None):
    return mgr.save(step, {"model": model, "optimizer": opt, "data": {"consumed_samples": step}, "rng": None}, META)


def test_optimizer_state_round_trip(tmp_path):
    model, mgr = Tiny(), CheckpointManager(tmp_path, log=lambda m: None)
    opt = _optimizer(model)
    _step(model, opt)
    path = _save(mgr, 1, model, opt)
    torch.manual_seed(1)
    model2 = Tiny()
    opt2 = _optimizer(model2)
    loaded = mgr.load(path, model2, opt2)
    assert loaded.step == 1 and loaded.data == {"consumed_samples": 1} and loaded.rng is None
    for (name, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, p2), name
        state, state2 = opt.optimizers["adamw"].state[p], opt2.optimizers["adamw"].state[p2]
        assert set(state) == set(state2) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(state[k], state2[k]) for k in state)
    _step(model, opt)
    _step(model2, opt2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_a_rank_reads_its_slice_and_partial_saves_are_refused(tmp_path):
    mgr = CheckpointManager(tmp_path, log=lambda m: None)
    source = Tiny()
    source.proj.weight = torch.nn.Parameter(torch.randn(6, 4))  # stored whole: (6, 4)
    path = _save(mgr, 1, source)
    target = Tiny()
    target.proj.weight = mark_param(torch.nn.Parameter(torch.zeros(3, 4)), (6, 4), [(0, 1, 2)])  # rows 3-5
    target.proj.bias = torch.nn.Parameter(torch.zeros(3))
    mgr.load(path, target)
    assert torch.equal(target.proj.weight, source.proj.weight[3:])
    with pytest.raises(CheckpointError, match=r"'model/proj.weight': the ranks' shards cover 12 of its 24 elements"):
        _save(mgr, 2, target)  # alone, this rank's half cannot make a checkpoint
    assert not (tmp_path / "step_00000002").exists()


def test_incompatible_checkpoints_are_refused(tmp_path):
    model, mgr = Tiny(), CheckpointManager(tmp_path, log=lambda m: None)
    opt = _optimizer(model)
    _step(model, opt)
    path = _save(mgr, 1, model, opt)
    with pytest.raises(CheckpointError, match=r"'proj.weight' is stored with global shape \(3, 4\), this model's is"):
        mgr.load(path, Tiny(width=5))
    with pytest.raises(CheckpointError, match="has no tensor 'gate', which this model has"):
        mgr.load(path, Tiny(extra=True))
    extra = Tiny(extra=True)
    path2 = _save(mgr, 2, extra)
    with pytest.raises(CheckpointError, match="1 stored tensors have no place in this model/layout .*model/gate"):
        mgr.load(path2, Tiny())
    with pytest.raises(CheckpointError, match="holds no optimizer state; load the model only"):
        mgr.load(path2, extra, _optimizer(extra))
    with pytest.raises(CheckpointError, match="optimizer state of 'proj.weight' was saved by 'adamw', this run "
                                              "updates it with 'sgd'"):
        mgr.load(path, Tiny(), _optimizer(Tiny(), "sgd"))
    frozen = Tiny()
    frozen.proj.bias.requires_grad_(False)
    opt = HybridOptimizer({"adamw": torch.optim.AdamW([{"params": [("proj.weight", frozen.proj.weight)],
                                                        "lr_mult": 1.0}])})
    with pytest.raises(CheckpointError, match="3 stored optimizer state tensors belong to no parameter this run "
                                              "updates .*optim/adamw/proj.bias/exp_avg"):
        mgr.load(path, frozen, opt)


def test_retention_never_deletes_newest_valid(tmp_path):
    mgr, model = CheckpointManager(tmp_path, keep_last=1, log=lambda m: None), Tiny()
    for step in (1, 2):
        _save(mgr, step, model)
    assert [p.name for p in mgr.store.committed()] == ["step_00000002"]
    shard = tmp_path / "step_00000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])  # the newest is corrupt; step 1 is gone
    _save(mgr, 1, model)  # e.g. a run restarted from an earlier checkpoint
    assert "step_00000001" in [p.name for p in mgr.store.committed()]
    assert mgr.store.latest_valid() == tmp_path / "step_00000001"


def test_same_step_saved_again_replaces_it(tmp_path):
    mgr, model = CheckpointManager(tmp_path, log=lambda m: None), Tiny()
    _save(mgr, 1, model)
    with torch.no_grad():
        model.proj.weight.add_(1.0)
    _save(mgr, 1, model)
    target = Tiny()
    mgr.load(tmp_path / "step_00000001", target)
    assert torch.equal(target.proj.weight, model.proj.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]


def test_async_save_commits_in_background(tmp_path):
    mgr, model = CheckpointManager(tmp_path, async_save=True, log=lambda m: None), Tiny()
    path = mgr.save(1, {"model": model, "optimizer": None, "data": None, "rng": None}, META, blocking=False)
    with torch.no_grad():
        model.proj.weight.zero_()  # training goes on: the snapshot was taken before
    mgr.wait()
    target = Tiny()
    mgr.load(path, target)
    assert not torch.equal(target.proj.weight, model.proj.weight)
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"


@pytest.mark.parametrize("pointer", [b"\xff\xfe\x00\x9c step_00000001", b"../../etc/passwd\n", b""],
                         ids=["binary", "not-a-step-name", "empty"])
def test_unusable_latest_pointer_is_ignored_with_a_note(tmp_path, pointer):
    """A binary ``latest`` (a torn or overwritten file) was a UnicodeDecodeError traceback on
    resume; like any unusable pointer it is ignored, said so, and the newest valid step is used."""
    notes: list[str] = []
    mgr, model = CheckpointManager(tmp_path, log=notes.append), Tiny()
    for step in (1, 2):
        _save(mgr, step, model)
    (tmp_path / "latest").write_bytes(pointer)
    assert mgr.resume_path() == tmp_path / "step_00000002"
    if pointer:
        assert len(notes) == 1 and str(tmp_path / "latest") in notes[0] and "ignored" in notes[0], notes


def test_load_only_takes_part_of_another_model(tmp_path):
    """``load_only``: a later phase keeps one part of an earlier phase's model (the vision encoder of
    a contrastive run); its own other tensors keep their initialisation, the checkpoint's are left behind."""
    mgr = CheckpointManager(tmp_path, log=lambda m: None)
    earlier = Tiny(extra=True)  # proj.* is the part handed on, gate the part left behind
    with torch.no_grad():
        earlier.proj.weight.fill_(2.0)
    path = _save(mgr, 1, earlier)
    later = Tiny()
    later.head = torch.nn.Linear(3, 2)  # new in the later phase
    head = later.head.weight.detach().clone()
    loaded = mgr.load(path, later, load_only=("proj.",))
    assert torch.equal(later.proj.weight, earlier.proj.weight) and torch.equal(later.head.weight, head)
    assert loaded.fresh_model == ["bias_stat", "head.bias", "head.weight"]
    with pytest.raises(CheckpointError, match="has no tensor 'head.weight'"):
        mgr.load(path, later)  # without load_only the mismatch is still refused


def test_load_only_needs_a_model_only_load():
    from megatron_s2.config.checkpoint import CheckpointConfig
    from megatron_s2.config.schema import ConfigError

    with pytest.raises(ConfigError, match="checkpoint.load_only: .*load_optimizer: false"):
        CheckpointConfig(load="runs/x", load_only=("vision.",))
    assert CheckpointConfig(load_only=("vision.",)).load_only == ("vision.",)  # a pipeline phase: load comes later
    assert CheckpointConfig(load="runs/x", load_optimizer=False, load_only=("vision.",)).load_only == ("vision.",)
