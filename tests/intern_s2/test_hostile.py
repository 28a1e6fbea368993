"""The Intern-S2 family used carelessly (issue 23's review as a new, then a hostile, user): every
mistake is one line and exit code 2 naming the field or file and the fix, before a rank starts or
a file is written; what the README documents works from its commands alone.

Each test names what it found broken: a `config.json` whose values have the wrong JSON type
(a traceback, or a "shape" error for ``vocab_size: true``), keys left out taking other defaults
than ``transformers``' reference, an exported `config.json` edited by hand silently ignored,
`plan layouts` crashing on a V4.1 field, layouts the family refuses to train accepted by the
checkpoint tools and proposed by the planner, `--prefix-caching` silently ignored, a
tokenizer-less import that could not be exported again, and an import into ``<run>/checkpoints``
(or a reshard) that `generate` / `serve` could not read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_s2.cli import main
from megatron_s2.config.recipe import load_recipe
from megatron_s2.config.schema import ConfigError
from megatron_s2.models.family import family_of
from megatron_s2.models.intern_s2.config import InternS2Config
from megatron_s2.models.intern_s2.hf import QwenMoEAdapter
from tests.intern_s2.conftest import HF_SHAPE

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "intern_s2" / "pretrain_tiny.yaml"
IDS = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(3))


def _hf_config(**changes) -> dict:
    """The config.json ``save_pretrained`` writes for the test shape, with ``changes``."""
    from transformers import Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(**HF_SHAPE).to_dict()
    config.update(changes)
    return config


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# ---- config.json: types, defaults, hand edits ------------------------------------------------

@pytest.mark.parametrize("key, value", [("vocab_size", 128.0), ("vocab_size", 128.5), ("vocab_size", True),
                                        ("vocab_size", "128"), ("hidden_size", [64]), ("num_experts", None),
                                        ("rms_norm_eps", "1e-6"), ("rms_norm_eps", float("nan")),
                                        ("layer_types", "full_attention"), ("head_dim", 16.0)])
def test_config_json_values_of_the_wrong_type_are_one_line_errors(key, value):
    """Was: 128.0 / 128.5 crashed model construction with a traceback, ``true`` became a
    vocabulary of 1 and failed on the embedding's shape, a string length counted its letters."""
    with pytest.raises(ConfigError) as info:
        QwenMoEAdapter().config_from_hf(_hf_config(**{key: value}))
    message = str(info.value)
    assert message.startswith(f"config.json: {key}") and "\n" not in message, message


@pytest.mark.parametrize("changes, field", [({"num_key_value_heads": 3}, "model.num_kv_heads"),
                                            ({"linear_num_value_heads": 3}, "model.linear_num_key_heads"),
                                            ({"layer_types": ["linear_attention"] * 3}, "model.layer_types"),
                                            ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]},
                                             "model.layer_types"),
                                            ({"num_experts_per_tok": 9}, "model.moe_topk")])
def test_an_impossible_model_names_the_file_and_the_field(changes, field):
    with pytest.raises(ConfigError) as info:
        QwenMoEAdapter().config_from_hf(_hf_config(**changes))
    assert str(info.value).startswith("config.json") and field in str(info.value), str(info.value)


def test_config_json_of_the_wrong_type_through_the_cli(hf_reference, tmp_path, capsys):
    source = tmp_path / "hf"
    shutil.copytree(hf_reference[1], source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "vocab_size": 128.0}))
    assert main(["checkpoint", "import", str(source), str(tmp_path / "out"), "--no-progress"]) == 2
    assert "config.json: vocab_size" in _one_line_error(capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["head_dim", "shared_expert_intermediate_size", "linear_conv_kernel_dim",
                                 "rms_norm_eps", "router_aux_loss_coef", "initializer_range", "layer_types",
                                 "rope_parameters"])
def test_keys_left_out_take_the_references_defaults(key):
    """``transformers`` fills a key a config.json leaves out with its class default (head_dim 256,
    a 512-wide shared expert); the import read another model (hidden / heads, no shared expert)."""
    from transformers import Qwen3_5MoeTextConfig

    config = _hf_config()
    del config[key]
    theirs = Qwen3_5MoeTextConfig(**config).to_dict()
    ours = QwenMoEAdapter().config_to_hf(QwenMoEAdapter().config_from_hf(config), "float32")
    if key == "rope_parameters":
        for k in ("rope_theta", "partial_rotary_factor"):
            assert ours[key][k] == theirs[key][k], k
    else:
        assert ours[key] == theirs[key]


@pytest.mark.parametrize("key, value", [("tie_word_embeddings", True), ("num_hidden_layers", 3),
                                        ("layer_types", ["full_attention"] * 4), ("rms_norm_eps", 1e-5),
                                        ("rope_parameters", {"rope_type": "default", "rope_theta": 5e5,
                                                             "partial_rotary_factor": 0.25})])
def test_an_exported_config_edited_by_hand_is_refused(key, value):
    """An export's config.json carries our block and the Hugging Face keys; ``transformers``
    reads the latter. An edit of one was silently ignored by the import (the block won), so the
    two readers loaded different models."""
    adapter = QwenMoEAdapter()
    exported = adapter.config_to_hf(InternS2Config(), "float32")
    assert adapter.config_from_hf(json.loads(json.dumps(exported))) == InternS2Config()
    with pytest.raises(ConfigError, match=f"config.json: {key}=.*disagrees with the megatron_s2 block"):
        adapter.config_from_hf({**exported, key: value})


def test_an_export_block_of_a_newer_format_is_refused():
    exported = QwenMoEAdapter().config_to_hf(InternS2Config(), "float32")
    exported["megatron_s2"]["format_version"] = 99
    with pytest.raises(ConfigError, match="format_version 99 is newer"):
        QwenMoEAdapter().config_from_hf(exported)


# ---- layouts the family cannot run ---------------------------------------------------------------

@pytest.mark.parametrize("override, field", [("parallel.recompute=selective", "parallel.recompute")])
def test_checkpoint_tools_refuse_a_layout_the_family_cannot_run(override, field, hf_reference, tmp_path, capsys):
    """``checkpoint import`` and ``reshard`` wrote checkpoints for selective recompute, which
    ``train`` then refused; the refusal now lives in the layout every tool builds."""
    out = tmp_path / "imported"
    assert main(["checkpoint", "import", str(hf_reference[1]), str(out), override, "--no-progress"]) == 2
    assert field in _one_line_error(capsys) and not out.exists()
    assert main(["checkpoint", "import", str(hf_reference[1]), str(out), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["checkpoint", "reshard", str(out), str(tmp_path / "resharded"), override, "--world-size", "1"]) == 2
    assert field in _one_line_error(capsys) and not (tmp_path / "resharded").exists()


def test_plan_layouts_ranks_the_familys_layouts(capsys):
    """`plan layouts` crashed on ``cfg.engram_layers`` (a V4.1 field)."""
    from megatron_s2.planning.layouts import enumerate_layouts

    assert main(["plan", "layouts", str(TINY), "--gpus", "4", "--top", "3"]) == 0
    assert "valid layouts for 4 GPUs" in capsys.readouterr().out
    kept, rejected = enumerate_layouts(load_recipe(TINY), 4)
    assert kept and all(layout.engram == 1 for _, layout in kept)  # no Engram in this family
    assert not any("engram" in r.reason for r in rejected)


# ---- the engine -------------------------------------------------------------------------------------

def test_prefix_caching_is_refused_not_ignored():
    """``serve --prefix-caching`` was accepted and did nothing (recurrent states are not prefix
    snapshots) while the page pool doubled."""
    from megatron_s2.config.engine import EngineConfig

    cfg = InternS2Config()
    model = family_of(cfg).build_model(cfg).eval()
    with pytest.raises(ConfigError, match="prefix_caching"):
        family_of(cfg).executor(model, EngineConfig(prefix_caching=True), torch.device("cpu"))


# ---- conversion round trips from the README's commands ------------------------------------------------

def test_an_import_without_tokenizer_exports_again(hf_reference, tmp_path, capsys):
    """A `save_pretrained` folder has no tokenizer; import accepted it (the family has no token
    map), but export refused for want of "the model's Engram hashes"."""
    from transformers import Qwen3_5MoeForCausalLM

    reference, source = hf_reference
    assert main(["checkpoint", "import", str(source), str(tmp_path / "ckpt"), "parallel.tp=2", "--no-progress"]) == 0
    code = main(["checkpoint", "export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--no-progress"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "verification (export -> import): passed" in out.out
    exported = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(exported(IDS).logits, reference(IDS).logits)


def test_an_import_into_a_runs_checkpoints_and_its_reshard_generate(hf_reference, tmp_path, capsys):
    """``checkpoint import <hf> runs/x/checkpoints`` failed when ``runs/x`` did not exist yet
    (a rename into a missing folder), and ``generate runs/x`` then missed the tokenizer the
    import wrote to ``runs/x/checkpoints/tokenizer``; a reshard's output carried no tokenizer."""
    run = tmp_path / "runs" / "imported"
    assert main(["checkpoint", "import", str(hf_reference[1]), str(run / "checkpoints"), "parallel.tp=2",
                 "--tokenizer", "char", "--no-progress"]) == 0
    for where in (run, run / "checkpoints"):
        assert main(["generate", str(where), "--prompt", "ab", "--max-tokens", "3", "--temperature", "0"]) == 0
    capsys.readouterr()
    resharded = tmp_path / "resharded" / "checkpoints"
    assert main(["checkpoint", "reshard", str(run / "checkpoints"), str(resharded), "parallel.tp=1",
                 "--world-size", "1"]) == 0
    assert main(["generate", str(resharded), "--prompt", "ab", "--max-tokens", "3", "--temperature", "0"]) == 0
    assert "ab" in capsys.readouterr().out


def test_a_checkpoint_missing_tensors_is_one_line(hf_reference, tmp_path, capsys):
    """The missing tensors were listed one per line under a header (13 lines for 12)."""
    from safetensors.torch import load_file, save_file

    source = tmp_path / "hf"
    source.mkdir()
    shutil.copy(hf_reference[1] / "config.json", source)
    tensors = load_file(hf_reference[1] / "model.safetensors")
    for name in [k for k in tensors if ".self_attn." in k or k.endswith("linear_attn.A_log")]:
        del tensors[name]
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    assert main(["checkpoint", "import", str(source), str(tmp_path / "out"), "--no-progress"]) == 2
    err = _one_line_error(capsys)
    assert "tensors of the model are not in the checkpoint" in err and "model.layers.3.self_attn." in err


def test_a_bfloat16_export_keeps_what_the_release_stores_in_float32(hf_reference, tmp_path, capsys):
    """The released Qwen3.5 checkpoints store ``linear_attn.A_log`` (the decay, compounded over
    every token of the recurrence) and ``linear_attn.norm.weight`` in float32; ``--dtype
    bfloat16`` cast them too."""
    from safetensors import safe_open

    assert main(["checkpoint", "import", str(hf_reference[1]), str(tmp_path / "ckpt"), "--no-progress"]) == 0
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--dtype", "bfloat16",
                 "--no-progress"]) == 0
    capsys.readouterr()
    dtypes = {}
    for file in (tmp_path / "hf").glob("model*.safetensors"):
        with safe_open(file, "pt") as f:
            dtypes.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    float32 = sorted(k for k, v in dtypes.items() if v == "F32")
    assert float32 == sorted(f"model.layers.{i}.linear_attn.{p}" for i in range(3) for p in ("A_log", "norm.weight"))
    assert dtypes["model.layers.0.linear_attn.dt_bias"] == dtypes["lm_head.weight"] == "BF16"


def test_a_pure_bfloat16_model_exports_and_imports_with_its_dtypes(tmp_path, capsys):
    """``params_dtype: bfloat16``: the export's own verification failed ("embedding ... differs,
    max |diff| 0"): the import gave each tensor the dtype of the model as constructed, before
    the precision map that ``init_weights`` applies cast the embedding to bfloat16."""
    from megatron_s2.checkpoint.hf.convert import load_hf_checkpoint
    from megatron_s2.checkpoint.offline import write_model_state

    recipe = load_recipe(TINY, ["model.params_dtype=bfloat16", "model.compute_dtype=bfloat16"])
    model = family_of(recipe.model).build_model(recipe.model).init_weights(0)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    assert state["embedding.word_embeddings.weight"].dtype == torch.bfloat16
    write_model_state(state, recipe, tmp_path / "ckpt", world_size=1)
    code = main(["checkpoint", "export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--tokenizer", "char",
                 "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and "verification (export -> import): passed" in out, out
    _, imported, _ = load_hf_checkpoint(tmp_path / "hf", progress=False)
    assert {k: v.dtype for k, v in imported.items()} == {k: v.dtype for k, v in state.items()}


# ---- post-training -------------------------------------------------------------------------------

def test_the_model_implements_every_call_of_the_family_model_contract():
    """RL with sequence parallelism (a separate rollout copy), OPD teachers and ``reference_kl``
    call ``apply_precision_map`` on the family's model; the contract did not list it, the model
    lacked it, and `launch` crashed in its memory pre-flight."""
    from megatron_s2.models.family.base import FamilyModel

    model = family_of(InternS2Config()).build_model(InternS2Config())
    calls = [n for n in vars(FamilyModel) if not n.startswith("_") and callable(getattr(FamilyModel, n))]
    assert "apply_precision_map" in calls
    assert [n for n in calls if not callable(getattr(model, n, None))] == []


def test_rl_with_sequence_parallelism_plans_its_rollout_copy():
    from megatron_s2.planning.memory import estimate_memory

    rl = REPO / "recipes" / "phases" / "rl_addition.yaml"
    recipe = load_recipe(rl, ["model=intern_s2_tiny", "model.params_dtype=bfloat16", "parallel.tp=2",
                              "parallel.sequence_parallel=true"])
    copy = [v for k, v in estimate_memory(recipe, 2).peak.resident.items() if k.startswith("rollout weight copy")]
    params = family_of(recipe.model).account(recipe.model).figures["params"]
    # tp=2 halves the matrices; the bf16 copy keeps the float32 islands (router, head, vectors)
    assert len(copy) == 1 and params < copy[0] < 2 * params


def _recorded(model, ids):
    from megatron_s2.models.family.routing_replay import RoutingMode, RoutingReplay

    record = RoutingReplay(RoutingMode.RECORD)
    with torch.no_grad():
        model(ids, model.make_context({"tokens": ids}, routing=record))
    return record


def test_rl_micro_batches_replay_the_rollouts_routing():
    """R3: the RL trainer hands each micro-batch its rollout's routing as ``mb["routing"]``;
    the family's ``make_context`` ignored it, so RL trained on freshly routed experts."""
    from megatron_s2.models.family.routing_replay import RoutingMode, RoutingReplay

    cfg = InternS2Config()
    model = family_of(cfg).build_model(cfg).init_weights(0).eval()
    ids = IDS[:, :20]
    shifted = {layer: [(e + 1) % cfg.num_routed_experts for e in entries]  # other experts than top-k
               for layer, entries in _recorded(model, ids).records().items()}
    replay = RoutingReplay(RoutingMode.REPLAY, shifted)
    ctx = model.make_context({"tokens": ids, "routing": replay})
    assert ctx.routing is replay
    with torch.no_grad():
        replayed, fresh = model(ids, ctx), model(ids)
    assert not torch.allclose(replayed, fresh)


def test_full_recompute_replays_the_routing_and_adds_aux_losses_once():
    """``parallel.recompute: full``: the recomputed forward in backward asked the replay for a
    second call (KeyError: "call 2 has nothing to replay") and added the load-balancing loss a
    second time (its logged value doubled)."""
    cfg = InternS2Config()
    model = family_of(cfg).build_model(cfg).init_weights(0).train()
    ids = IDS[:, :20]
    record = _recorded(model, ids)
    results = {}
    for mode in ("none", "full"):
        model.set_recompute(mode)
        model.zero_grad()
        ctx = model.make_context({"tokens": ids, "routing": record.replayer()})
        logits = model(ids, ctx)
        (logits.pow(2).mean() + ctx.total_aux_loss()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[mode] = (float(ctx.aux_losses["moe_load_balance"].detach()), grads)
    assert results["full"][0] == results["none"][0]
    for name, grad in results["none"][1].items():
        assert torch.allclose(results["full"][1][name], grad, rtol=1e-5, atol=1e-7), name
