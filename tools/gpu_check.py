"""The prepared GPU check (issue 13 item 6): run by ``tools/gpu_check.sh``, or on CPU as a smoke run.

    python tools/gpu_check.py --out DIR                 # on a GPU machine (device cuda)
    python tools/gpu_check.py --smoke --out DIR         # CPU, tiny shapes, Triton interpreter

Each part of :mod:`gpu_check_parts` runs in its own process with its own timeout, so a crash,
a hang or a missing dependency in one part does not stop the others; the whole run stays
inside ``--budget`` seconds (default 450: the 8 minutes of the check minus installation). The
results go to ``DIR/gpu_check.json`` (every check and figure) and ``DIR/gpu_check.md`` (a
short summary); each part's output is in ``DIR/logs/<part>.log``. Exit code 0 when every
check of every part passed, 1 otherwise, 2 without a CUDA GPU (not a smoke run): one line, and
a JSON / markdown saying that the check has not run.

Internal modes: ``--part NAME`` runs one part in this process; ``--cli ARGS`` runs
``megatron-s2 ARGS`` with the repository importable whether or not ``pip install`` worked.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_parts as parts  # noqa: E402

# (part, timeout on a GPU in seconds, timeout of the CPU smoke run)
PLAN = (("env", 40, 60), ("kernel_parity", 70, 120), ("kernel_bench", 70, 120), ("train_parity", 90, 180),
        ("main_recipe", 90, 180), ("layer_mfu", 70, 120), ("decode", 45, 120))
MIN_SECONDS = 15  # a part is skipped rather than started with less than this left


def run_part(name: str, args) -> int:
    ctx = parts.Context(device=args.device, out=Path(args.out), smoke=args.smoke)
    (ctx.out / "parts").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        parts.bootstrap_imports()
        import torch

        if ctx.smoke:
            torch.set_num_threads(1)
        # Parity checks compare float32 against float32: no TF32 (containers may enable it by default).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        result = parts.PARTS[name](ctx)
        result["status"] = "ok" if all(c["ok"] for c in result["checks"]) else "failed"
    except Exception as exc:  # reported in the JSON; the other parts still run
        result = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                  "checks": [], "figures": {}, "notes": []}
    result["seconds"] = round(time.perf_counter() - t0, 2)
    (ctx.out / "parts" / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    return 0 if result["status"] == "ok" else 1


def no_gpu(args) -> int | None:
    """On a machine where the GPU run cannot run (no CUDA device visible to this torch), say so in
    one line, write a JSON / markdown that say so too, and return exit code 2; None when a GPU
    is there (or on a smoke run)."""
    if args.smoke:
        return None
    import torch

    if torch.cuda.is_available():
        return None
    why = (f"no CUDA GPU is visible here (torch {torch.__version__}, torch.cuda.is_available() is False, "
           f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); the GPU check has NOT run. "
           "Run it on a GPU machine, or use --smoke for the CPU run of the same parts")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps({"device": args.device, "smoke": False, "ok": False,
                                                    "no_gpu": True, "error": why, "parts": {}}, indent=1))
    (out / "gpu_check.md").write_text(f"# GPU check ({args.device}): NOT RUN\n\n- {why}\n")
    print(f"gpu_check: {why}", file=sys.stderr)
    return 2


def orchestrate(args) -> int:
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "parts").mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(parts.ROOT), env.get("PYTHONPATH", "")) if p)
    if args.smoke:
        env["TRITON_INTERPRET"] = "1"
        env.setdefault("OMP_NUM_THREADS", "1")  # tiny shapes: one thread is fastest on shared CI cores
    report = {"device": args.device, "smoke": args.smoke, "budget_s": args.budget, "parts": {}}
    selected = [p for p in PLAN if not args.only or p[0] in args.only]
    for name, gpu_timeout, cpu_timeout in selected:
        left = deadline - time.monotonic()
        timeout = min(cpu_timeout if args.smoke else gpu_timeout, left)
        if timeout < MIN_SECONDS:
            report["parts"][name] = {"status": "skipped", "error": f"budget exhausted ({left:.0f} s left)", "checks": []}
            continue
        stale = out / "parts" / f"{name}.json"
        stale.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--part", name, "--out", str(out), "--device", args.device]
        cmd += ["--smoke"] if args.smoke else []
        t0 = time.monotonic()
        with open(out / "logs" / f"{name}.log", "w") as log:
            try:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout,
                                      cwd=parts.ROOT)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = None
        if stale.is_file():
            result = json.loads(stale.read_text())
        elif code is None:
            result = {"status": "timeout", "error": f"killed after {timeout:.0f} s", "checks": []}
        else:
            tail = (out / "logs" / f"{name}.log").read_text()[-600:]
            result = {"status": "error", "error": f"exit {code} without a result: {tail}", "checks": []}
        result["wall_s"] = round(time.monotonic() - t0, 1)
        report["parts"][name] = result
        print(f"[gpu_check] {name:<14} {result['status']:<8} {result['wall_s']:6.1f} s", flush=True)
    report["ok"] = all(p["status"] == "ok" for p in report["parts"].values()) and len(report["parts"]) == len(selected)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(summary(report))
    print((out / "gpu_check.md").read_text())
    return 0 if report["ok"] else 1


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    return str(v)


def summary(report: dict) -> str:
    lines = [f"# GPU check ({'CPU smoke run' if report['smoke'] else report['device']}): "
             f"{'all checks passed' if report['ok'] else 'FAILURES'}", ""]
    env = report["parts"].get("env", {}).get("figures", {})
    if env:
        lines.append(f"- {env.get('gpu', 'no GPU')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
                     f"Triton {env.get('triton', 'missing')}, python {env.get('python')}; pip install: "
                     f"{env.get('pip_install')}; ModuleSpec from {env.get('module_spec')}")
        missing = [k for k, v in env.get("dependencies", {}).items() if not v]
        lines.append(f"- missing modules: {', '.join(missing) or 'none'}")
    lines += ["", "| part | status | seconds | checks |", "|---|---|---|---|"]
    for name, p in report["parts"].items():
        passed = sum(c["ok"] for c in p.get("checks", []))
        lines.append(f"| {name} | {p['status']} | {p.get('wall_s', '')} | {passed}/{len(p.get('checks', []))} |")
    lines.append("")
    for name, p in report["parts"].items():
        for c in p.get("checks", []):
            mark = "ok" if c["ok"] else "FAIL"
            limit = f" (limit {_fmt(c['limit'])})" if c.get("limit") is not None else ""
            value = f": {_fmt(c['value'])}" if c.get("value") is not None else ""
            lines.append(f"- [{mark}] {name}: {c['name']}{value}{limit}")
        if p.get("error"):
            lines.append(f"- [{p['status'].upper()}] {name}: {p['error'].splitlines()[0][:300]}")
    figs = {n: report["parts"].get(n, {}).get("figures", {}) for n in ("kernel_bench", "layer_mfu", "main_recipe")}
    if figs["kernel_bench"]:
        lines += ["", "| kernel | triton ms | ref ms | TFLOP/s or GB/s | roofline |", "|---|---|---|---|---|"]
        for k, r in figs["kernel_bench"].items():
            rate = r.get("tflops", r.get("gbs"))
            lines.append(f"| {k} | {_fmt(r['triton_ms'])} | {_fmt(r['reference_ms'])} | {_fmt(rate)} | "
                         f"{_fmt(r.get('roofline_fraction'))} |")
    for label in ("bf16", "fp8_experts"):
        f = figs["layer_mfu"].get(label)
        if f:
            lines.append(f"- flagship-shaped layer, {label}: {_fmt(f['step_s'])} s/step, {_fmt(f['model_tflops'])} "
                         f"TFLOP/s, MFU {_fmt(f['mfu'])}")
    m = figs["main_recipe"]
    if m:
        lines.append(f"- main recipe (tiny, tp=pp=1): loss {_fmt(m.get('first_mean'))} -> {_fmt(m.get('last_mean'))}, "
                     f"{_fmt(m.get('step_time_s'))} s/step, {_fmt(m.get('tokens_per_s'))} tokens/s")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--cli"]:
        parts.bootstrap_imports()
        from megatron_s2.cli import main as cli_main

        return cli_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"), help="result directory (default $OUT)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (= --smoke)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton interpreter: seconds per part")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for all parts together")
    p.add_argument("--only", nargs="*", help="run only these parts")
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--gpu-present", action="store_true", help=argparse.SUPPRESS)  # gpu_check.sh: only this check
    args = p.parse_args(argv)
    if args.device == "cpu":
        args.smoke = True
    if args.smoke:
        args.device = "cpu"
    if not args.part:
        code = no_gpu(args)
        if code is not None or args.gpu_present:
            return code or 0
    if args.part:
        if args.smoke:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        return run_part(args.part, args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
