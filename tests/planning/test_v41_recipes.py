"""Every phase of the V4.1 report as a flagship recipe that fits its stated cluster, and as a
tiny CPU recipe; the pipeline files chain them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_s2.config.recipe import RECIPES_DIR, load_recipe
from megatron_s2.data.jsonl import preprocess_jsonl
from megatron_s2.data.tokenizer import load_tokenizer
from megatron_s2.launcher.launch import prepare_runs
from megatron_s2.planning.memory import estimate_memory

V41 = Path(__file__).resolve().parents[2] / "recipes" / "v41"
H200_BYTES = 141e9
TOKENS_PER_STEP = 1536 * 65536  # §4.2.2: 100.6M tokens per step


@pytest.fixture
def flagship_inputs(tmp_path, monkeypatch):
    """What `launch --slurm` checks on the submit host, as small stand-ins in a working
    directory: the tokenizer folder, the data files and the checkpoints (a committed step
    directory each) the flagship recipes name (relative paths). The shipped tiny BPE stands in
    for the release tokenizer (its pad id is the release's Engram pad id, 2)."""
    tok_dir = tmp_path / "checkpoints" / "DeepSeek-V4.1-Flash"
    shutil.copytree(RECIPES_DIR / "tokenizers" / "tiny-bpe", tok_dir)
    text = tmp_path / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(4)))
    tokenizer = load_tokenizer(tok_dir)
    for prefix in ("data/pretrain/text", "data/pretrain/multimodal_text"):
        preprocess_jsonl([text], tmp_path / prefix, tokenizer)
    (tmp_path / "data" / "sft").mkdir(parents=True)
    chats = [json.loads(line) for line in (RECIPES_DIR / "data" / "tiny_chat.jsonl").read_text().splitlines()[:8]]
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "data" / "sft" / "conversations.parquet")
    import io
    import tarfile

    from megatron_s2.data.procedural_images import procedural_items

    for shard in ("data/multimodal/shards-000000.tar", "data/multimodal/shards-000001.tar",
                  "data/vision/alt_text-000000.tar", "data/vision/alt_text-000001.tar"):  # image-text stand-ins
        (tmp_path / shard).parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tmp_path / shard, "w") as archive:
            for i, item in enumerate(procedural_items(2, seed=0, size=48)):
                png = io.BytesIO()
                item.image.save(png, format="PNG")
                for name, data in ((f"{i:03d}.png", png.getvalue()), (f"{i:03d}.txt", item.caption.encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    archive.addfile(info, io.BytesIO(data))
    for name in ("pretrain_64k", "extend_1m", "sft", "rl", "vision_ar", "teachers/math", "teachers/logic"):  # what phases load
        start = f"checkpoints/{name}" if name.startswith("teachers") else f"runs/v41_flagship/{name}/checkpoints"
        (tmp_path / start / "step_00000001").mkdir(parents=True)
        (tmp_path / start / "step_00000001" / "COMMITTED").write_text("stand-in")
    monkeypatch.chdir(tmp_path)
    # The recipes name their clusters' partition; whatever SLURM this machine (or an earlier
    # launcher test's local cluster) knows is not that cluster, so sinfo is pointed at no
    # configuration and the capacity query says "cannot tell" (tests/launcher checks it for real).
    # A configuration naming no controller: sinfo exits 1 at once, where a missing file makes it
    # retry for 60 s (the query's 10 s timeout, once per prepared phase: 120 s of this module).
    conf = tmp_path / "no-cluster" / "slurm.conf"
    conf.parent.mkdir()
    conf.write_text("ClusterName=none\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    return tmp_path


@pytest.mark.parametrize("name, nodes", [("flagship_pretrain_64k", 512), ("flagship_extend_1m", 512),
                                         ("flagship_sft", 128), ("flagship_rl", 128), ("flagship_opd", 128),
                                         ("flagship_pretrain_mm_64k", 512), ("flagship_vision_contrastive", 32)])
@pytest.mark.slow
def test_flagship_phase_fits_its_cluster(name, nodes, flagship_inputs):
    recipe = load_recipe(V41 / f"{name}.yaml")
    assert recipe.model.name == "flagship" and recipe.launcher.nodes == nodes and recipe.launcher.gpus_per_node == 8
    assert f"{nodes} nodes x 8 H200" in (V41 / f"{name}.yaml").read_text()  # the header states the cluster
    plan = estimate_memory(recipe, nodes * 8)
    assert plan.peak.total < 0.95 * H200_BYTES, f"{name}: {plan.peak.total / 2 ** 30:.1f} GiB"
    if recipe.model.vision_n_layers:  # the encoder is planned where it lives: the first stage (§3.1.1)
        first = min(plan.ranks, key=lambda r: r.pp_rank)
        assert first.state.parameters["vision encoder"] > 0.4e9 * 2  # ~485M parameters, bfloat16
        assert all("vision encoder" not in r.state.parameters for r in plan.ranks if r.pp_rank > 0)
    [run] = prepare_runs(str(V41 / f"{name}.yaml"), [], {}, None, local=False)  # launch --slurm --dry-run checks
    assert run.plan.world_size == nodes * 8


def test_pretraining_follows_the_report_schedule():
    """§4.2.2: 64K sequences, 100.6M-token batches, warm-up 2000, constant 2.6e-4 until 28T,
    cosine to 2.6e-5 by 40T, 1M context from 34T, 45T tokens in total."""
    from megatron_s2.optim.lr_schedule import LRSchedule

    pre, ext = load_recipe(V41 / "flagship_pretrain_64k.yaml"), load_recipe(V41 / "flagship_extend_1m.yaml")
    for recipe, seq in ((pre, 65536), (ext, 1 << 20)):
        t = recipe.training
        assert t.seq_length == seq and t.global_batch_size * t.seq_length == TOKENS_PER_STEP
    s = pre.schedule
    assert (s.lr, s.min_lr, s.warmup_steps, s.decay_start_tokens, s.decay_end_tokens) == (2.6e-4, 2.6e-5, 2000,
                                                                                       28e12, 40e12)
    assert (pre.training.train_steps - 1) * TOKENS_PER_STEP < 34e12 <= pre.training.train_steps * TOKENS_PER_STEP
    assert ext.schedule.start_tokens == 34e12
    total = (pre.training.train_steps + ext.training.train_steps) * TOKENS_PER_STEP
    assert abs(total - 45e12) < TOKENS_PER_STEP
    a, b = LRSchedule(pre.schedule, TOKENS_PER_STEP), LRSchedule(ext.schedule, TOKENS_PER_STEP)
    assert b.lr_at(0) == a.lr_at(pre.training.train_steps)  # the extension continues the curve


@pytest.mark.slow
def test_pipelines_chain_every_phase(flagship_inputs):
    flagship = prepare_runs(str(V41 / "flagship_pipeline.yaml"), [], {}, None, local=False)
    assert [r.phase for r in flagship] == ["pretrain_64k", "extend_1m", "sft", "rl", "opd"]
    assert flagship[3].recipe.checkpoint.load == str(flagship[2].job.run_dir / "checkpoints")
    tiny = prepare_runs(str(V41 / "tiny_pipeline.yaml"), [], {}, None, local=True)
    assert [r.phase for r in tiny] == ["pretrain", "sft"]
    assert tiny[1].recipe.checkpoint.load == str(tiny[0].job.run_dir / "checkpoints")
    assert tiny[1].recipe.data.kind == "chat" and tiny[1].recipe.phase.kind == "sft"
