"""Health checks: NVML inventory (real where a driver exists, scripted NVML otherwise),
the no-driver message, outlier naming, and the sniff test across ranks."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
from launcher_helpers import PAYLOADS

from megatron_s2.config.launcher import LauncherConfig
from megatron_s2.runtime.bootstrap import DistInfo
from megatron_s2.runtime.gpu_inventory import query_inventory
from megatron_s2.runtime.health import RankTiming, find_outliers, health_checks_enabled, run_health_checks

DRIVER = PAYLOADS / "local_driver.py"


class _NVMLError(Exception):
    pass


def scripted_nvml(ecc_uncorrected=(0, 0), supports_ecc=True) -> types.ModuleType:
    """A stand-in ``pynvml`` answering like a two-GPU node."""
    nvml = types.ModuleType("pynvml")
    nvml.NVML_VOLATILE_ECC, nvml.NVML_TEMPERATURE_GPU, nvml.NVML_CLOCK_SM = 0, 0, 1
    nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None
    nvml.nvmlSystemGetDriverVersion = lambda: b"550.54.15"
    nvml.nvmlDeviceGetCount = lambda: 2
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i
    nvml.nvmlDeviceGetName = lambda h: b"NVIDIA H200"
    nvml.nvmlDeviceGetUUID = lambda h: f"GPU-{h}"
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=141 * (1 << 30))
    nvml.nvmlDeviceGetTemperature = lambda h, kind: 40 + h
    nvml.nvmlDeviceGetClockInfo = lambda h, kind: 1980
    nvml.nvmlDeviceGetMaxClockInfo = lambda h, kind: 1980

    def ecc(h, kind, counter):
        if not supports_ecc:
            raise _NVMLError("Not Supported")
        return ecc_uncorrected[h] if kind == 1 else 7

    nvml.nvmlDeviceGetTotalEccErrors = ecc
    return nvml


def test_inventory_from_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", scripted_nvml(ecc_uncorrected=(0, 3)))
    inv = query_inventory("node7")
    assert inv.available and inv.message == "NVIDIA driver 550.54.15"
    assert [(g.index, g.name, g.memory_total_mib, g.temperature_c, g.ecc_uncorrected, g.ecc_corrected)
            for g in inv.gpus] == [(0, "NVIDIA H200", 141 * 1024, 40, 0, 7), (1, "NVIDIA H200", 141 * 1024, 41, 3, 7)]
    assert inv.problems() == ["node7: GPU 1 (GPU-1) has 3 uncorrected ECC errors"]
    assert inv.problems(expected_gpus=4)[-1] == "node7: 2 GPUs visible to NVML, 4 expected"


def test_unsupported_readings_are_missing_not_fatal(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", scripted_nvml(supports_ecc=False))
    inv = query_inventory("node7")
    assert inv.available and all(g.ecc_uncorrected is None for g in inv.gpus) and inv.problems() == []


def test_no_driver_is_a_message_not_a_crash(monkeypatch):
    broken = scripted_nvml()

    def no_library():
        raise _NVMLError("NVML Shared Library Not Found")

    broken.nvmlInit = no_library
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    inv = query_inventory("cpu-box")
    assert not inv.available and inv.gpus == () and inv.message.startswith("no NVIDIA driver found")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    assert query_inventory("cpu-box").message.startswith("no NVIDIA driver found (nvidia-ml-py is not installed")


def test_this_machine_never_crashes():
    inv = query_inventory("here")
    assert inv.available or inv.message.startswith("no NVIDIA driver found")


def timing(rank, host, gemm=0.01, reduce=0.002, gather=0.002):
    return RankTiming(rank, host, gemm, reduce, gather)


def test_outliers_are_named_by_rank_and_host():
    timings = [timing(0, "a"), timing(1, "a"), timing(2, "b", gemm=0.05), timing(3, "b", reduce=0.0021)]
    outliers = find_outliers(timings, factor=3.0)
    assert [(o.rank, o.host, o.measurement) for o in outliers] == [(2, "b", "gemm_s")]
    assert outliers[0].describe() == "rank 2 on b: gemm 50.00 ms is 5.0x the median 10.00 ms"
    tiny = [timing(0, "a", reduce=1e-5), timing(1, "a", reduce=9e-5)]
    assert find_outliers(tiny, 3.0) == [], "sub-millisecond jitter is not an outlier"


def test_enabled_by_default_under_slurm_only():
    assert health_checks_enabled(LauncherConfig(), env={"SLURM_JOB_ID": "1"})
    assert not health_checks_enabled(LauncherConfig(), env={})
    assert health_checks_enabled(LauncherConfig(health_checks="on"), env={})
    assert not health_checks_enabled(LauncherConfig(health_checks="off"), env={"SLURM_JOB_ID": "1"})


def test_single_process_sniff():
    report = run_health_checks(DistInfo(0, 1, 0, 1, "none"), gemm_size=64, iters=2)
    assert len(report.timings) == 1 and report.timings[0].gemm_s > 0 and report.ok
    assert "health: 1 ranks on 1 nodes" in report.format()


def test_sniff_across_ranks(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, str(DRIVER), str(run_dir), "2", sys.executable,
                             str(PAYLOADS / "health_check.py"), str(run_dir)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads((run_dir / "health.json").read_text())
    assert [t["rank"] for t in report["timings"]] == [0, 1]
    assert all(t["all_reduce_s"] > 0 and t["all_gather_s"] > 0 and t["host"] for t in report["timings"])
    assert len(report["nodes"]) == 1, "one inventory per node (local rank 0)"
    assert "all_reduce: median" in result.stdout


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_outlier_factor_must_exceed_one(factor):
    with pytest.raises(ValueError, match="launcher.health_outlier_factor"):
        LauncherConfig(health_outlier_factor=factor)
