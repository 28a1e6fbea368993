"""The Memory Decoder's phases (megatron_s2/posttrain/memdec): phase configuration errors, the 1:1
domain / general mix of router training, and the three tiny recipes run with ``megatron-s2 train``
(backbone -> memory decoder pre-training with its datastore -> router), plus the pipeline file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_s2.config.data import DataConfig
from megatron_s2.config.phase import PhaseConfig
from megatron_s2.config.schema import ConfigError, from_mapping
from megatron_s2.data import build_data_iterator, build_tokenizer

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"


@pytest.mark.parametrize("mapping, field", [
    ({"kind": "memdec"}, "phase.memdec_backbone"),
    ({"kind": "memdec_router", "memdec_backbone": "runs/b"}, "phase.memdec_general_data"),
    ({"kind": "memdec", "memdec_backbone": "runs/b", "memdec_beta": 1.5}, "phase.memdec_beta"),
    ({"kind": "memdec", "memdec_backbone": "runs/b", "memdec_knn_k": 0}, "phase.memdec_knn_k"),
    ({"kind": "memdec", "memdec_backbone": "runs/b", "memdec_knn_temperature": 0}, "phase.memdec_knn_temperature"),
    ({"kind": "memdec_router", "memdec_backbone": "b", "memdec_general_data": {"kind": "procedural_text"},
      "memdec_router_init_lambda": 1.0}, "phase.memdec_router_init_lambda"),
])
def test_phase_errors_name_the_field(mapping, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        from_mapping(PhaseConfig, mapping)


def test_router_data_mixes_domain_and_general_one_to_one_and_checkpoints():
    from megatron_s2.posttrain.memdec.trainer import MixedCorpusIterator

    def stream(corpus):
        cfg = from_mapping(DataConfig, {"kind": "procedural_text", "corpus": corpus, "num_documents": 40})
        return build_data_iterator(cfg, seq_length=32, global_batch_size=4, micro_batch_size=2, dp_rank=0, dp_size=1,
                                   seed=3, phase="memdec_router", tokenizer=build_tokenizer(cfg))

    mixed = MixedCorpusIterator(stream("domain"), stream("general"))
    first = mixed.next_step()
    assert [bool(mb["is_domain"].all()) for mb in first] == [True, True, False, False]
    assert all(mb["is_domain"].shape == mb["tokens"].shape for mb in first)
    state = mixed.state_dict()
    after = mixed.next_step()
    again = MixedCorpusIterator(stream("domain"), stream("general"))
    again.load_state_dict(state)
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(after, again.next_step()))


def _train(recipe: str, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "megatron_s2.cli", "train", str(RECIPES / recipe), "--run-dir", str(run_dir),
           "training.train_steps=3", "training.global_batch_size=4", "training.micro_batch_size=2",
           "logging.log_interval=1", *overrides]
    return subprocess.run(cmd, cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_memdec_recipes_train_backbone_memory_and_router(tmp_path):
    """The three phases through `megatron-s2 train`: the datastore is built once from the frozen
    backbone and saved as safetensors (a second run reads it back), the memory decoder's log carries
    Eq. 2's two terms, the router run leaves the backbone and memory untouched and saves the router
    with the memory (memdec_router.*), its lambda per corpus logged."""
    from safetensors import safe_open

    from megatron_s2.inference.weights import read_checkpoint

    backbone, memory, router = tmp_path / "backbone", tmp_path / "memory", tmp_path / "router"
    out = _train("memdec/backbone_general.yaml", backbone, "data.num_documents=40")
    assert out.returncode == 0, out.stderr[-3000:]
    out = _train("memdec/memory_pretrain.yaml", memory, f"phase.memdec_backbone={backbone}", "data.num_documents=30")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "built from the frozen backbone" in out.stdout and "memdec_kl" in out.stdout and "memdec_ce" in out.stdout
    store = memory / "datastore.safetensors"
    with safe_open(str(store), framework="pt") as f:
        meta = json.loads(f.metadata()["meta"])
        assert f.get_tensor("keys").shape[1] == 64 and len(meta["backbone"]) == 32  # the weights' digest
    out = _train("memdec/memory_pretrain.yaml", memory, f"phase.memdec_backbone={backbone}", "data.num_documents=30",
                 "training.train_steps=4")
    assert out.returncode == 0 and "read from" in out.stdout, out.stderr[-3000:]

    out = _train("memdec/router.yaml", router, f"phase.memdec_backbone={backbone}",
                 f"checkpoint.load={memory / 'checkpoints'}", "data.num_documents=30",
                 "phase.memdec_general_data.num_documents=30")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "memdec_lambda_domain" in out.stdout and "memdec_lambda_general" in out.stdout
    trained = read_checkpoint(str(router)).state
    before = read_checkpoint(str(memory)).state
    assert {"memdec_router.inp.weight", "memdec_router.out.weight"} <= set(trained)
    assert trained["memdec_router.inp.weight"].shape == (64, 64 + 32 + 4)
    for name, tensor in before.items():  # the memory decoder is frozen in router training
        assert torch.equal(trained[name], tensor), name

    # the plug-in next to its backbone: Eq. 3 per token, a distribution at every position
    from megatron_s2.models.memory_decoder import interpolate
    from megatron_s2.inference.memory_decoder import load_memory_decoder
    from megatron_s2.posttrain.memdec.fusion import load_fused

    fused, tokenizer = load_fused(backbone, router)
    tokens = torch.tensor([[tokenizer.bos_id, *tokenizer.encode("ACGU GAC. ab")]])
    out = fused.log_probs(tokens)
    assert out.fused.shape == (1, tokens.size(1), 128) and out.lam.shape == tokens.shape
    torch.testing.assert_close(out.fused.exp().sum(-1), torch.ones(tokens.shape), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.fused.exp(), interpolate(out.backbone.exp(), out.memory.exp(), out.lam),
                               rtol=1e-5, atol=1e-7)
    with pytest.raises(ConfigError, match="no router tensors"):
        load_memory_decoder(memory)

    # `megatron-s2 generate --memory-decoder`: the plug-in decodes next to its backbone; a run without
    # the router, or a backbone the plug-in was not made for, exits 2 with one line
    def generate(checkpoint, plugin):
        cmd = [sys.executable, "-m", "megatron_s2.cli", "generate", str(checkpoint), "--memory-decoder", str(plugin),
               "--prompt", "ACGU", "--temperature", "0", "--max-tokens", "4", "--device", "cpu"]
        return subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=300)

    out = generate(backbone, router)
    assert out.returncode == 0 and "+ memory decoder" in out.stderr and "finish reason" in out.stderr, out.stderr[-2000:]
    for checkpoint, plugin, said in ((backbone, memory, "no router tensors"), (memory, router, "the router of")):
        out = generate(checkpoint, plugin)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and said in lines[0], out.stderr[-2000:]


@pytest.mark.slow
def test_memdec_pipeline_file_resolves(tmp_path):
    """recipes/memdec_tiny.yaml validates as a pipeline (``launch --dry-run``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "megatron_s2.cli", "launch", str(RECIPES / "memdec_tiny.yaml"), "--local",
                          "--dry-run", "--run-dir", str(tmp_path / "p")], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # ${phase:backbone} resolved in both later phases (an unresolved reference is a ConfigError)
    said = out.stdout + out.stderr
    assert all(f"phase {name}:" in said for name in ("backbone", "memory", "router")), said


def test_datastore_keys_are_the_frozen_backbones_hidden_states_and_a_changed_backbone_is_detected():
    """Step 1 of the walkthrough: one (key, next token) pair per target position, the key being the
    backbone's normalised last hidden state of the prefix; the cache fingerprint follows the weights."""
    import yaml

    from megatron_s2.config.model_schema import ModelSchema
    from megatron_s2.data.procedural_text import build_procedural_text_documents
    from megatron_s2.models.family import family_of
    from megatron_s2.posttrain.memdec.datastore import build_datastore, weights_fingerprint
    from megatron_s2.posttrain.memdec.forward import hidden_and_log_probs

    cfg = from_mapping(ModelSchema, yaml.safe_load((RECIPES / "models" / "intern_s2_tiny.yaml").read_text()))
    model = family_of(cfg).build_model(cfg)
    model.init_weights(0)
    model.eval()
    tok = build_tokenizer(DataConfig())
    docs = build_procedural_text_documents("domain", 3, 0, tok)
    store = build_datastore(model, [docs], seq_length=64, pad_id=tok.pad_id)
    assert len(store) == sum(int(n) - 1 for n in docs.sizes)
    first = torch.from_numpy(docs.tokens(0).astype("int64"))
    n = len(first) - 1
    hidden, _ = hidden_and_log_probs(model, {"tokens": first[:-1].unsqueeze(0)})
    torch.testing.assert_close(store.keys[:n], hidden[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(store.values[:n], first[1:])
    before = weights_fingerprint(model)
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)
    assert weights_fingerprint(model) != before
