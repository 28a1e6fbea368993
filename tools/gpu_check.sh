#!/usr/bin/env bash
# The prepared GPU check (issue 13 item 6): at most 8 minutes on one H200, no network.
#
#   bash tools/gpu_check.sh [OUT_DIR]        # default: $OUT, else ./gpu_check_out
#   bash tools/gpu_check.sh --smoke [OUT]    # the same parts on CPU, tiny shapes (what CI runs)
#   (--smoke may come before or after OUT_DIR; an unknown option or an unwritable OUT_DIR: exit 2)
#
# 1. installs this checkout with the machine's own torch: pip install -e . --no-deps
#    (offline, no build isolation); a failure is reported, not fatal: the parts import the
#    repository from its path. Wheels of missing pure dependencies (PyYAML, safetensors,
#    megatron-core, ...) are installed offline from $GPU_CHECK_WHEELS (default .gpu_wheels/,
#    an ignored directory the caller may carry) when that directory exists.
# 2. runs tools/gpu_check.py: env, kernel_parity, kernel_bench, train_parity, main_recipe,
#    layer_mfu, decode -- one process per part, each with its own timeout, 450 s in all.
# 3. leaves OUT_DIR/gpu_check.json, OUT_DIR/gpu_check.md and OUT_DIR/logs/*.log.
# Exit code: 0 when every check passed, 1 otherwise; 2 (one line, nothing installed or run)
# when no CUDA GPU is visible and --smoke was not given.
set -u
cd "$(dirname "$0")/.." || exit 1
SMOKE=()
OUT_DIR=""
for arg in "$@"; do
    case "$arg" in
        --smoke) SMOKE=(--smoke) ;;
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "gpu_check.sh: unknown option '$arg'; usage: bash tools/gpu_check.sh [--smoke] [OUT_DIR]" >&2; exit 2 ;;
        *) if [ -n "$OUT_DIR" ]; then
               echo "gpu_check.sh: one OUT_DIR only (got '$OUT_DIR' and '$arg'); usage: bash tools/gpu_check.sh [--smoke] [OUT_DIR]" >&2
               exit 2
           fi
           OUT_DIR="$arg" ;;
    esac
done
OUT_DIR="${OUT_DIR:-${OUT:-gpu_check_out}}"
if ! mkdir -p "$OUT_DIR/logs" 2>/dev/null || [ ! -w "$OUT_DIR" ]; then
    echo "gpu_check.sh: OUT_DIR '$OUT_DIR' is not a writable directory; give another one" >&2
    exit 2
fi
PY="${PYTHON:-python}"
START=$(date +%s)

WHEELS="${GPU_CHECK_WHEELS:-.gpu_wheels}"
if [ -d "$WHEELS" ]; then
    missing=$("$PY" - <<'EOF'
import importlib.util
mods = {"yaml": "PyYAML", "safetensors": "safetensors", "numpy": "numpy", "megatron.core": "megatron-core",
        "tqdm": "tqdm"}
out = []
for mod, pkg in mods.items():
    try:
        if importlib.util.find_spec(mod) is None:
            out.append(pkg)
    except (ImportError, ValueError):
        out.append(pkg)
print(" ".join(out))
EOF
)
    if [ -n "$missing" ]; then
        timeout 120 "$PY" -m pip install --no-index --no-deps --find-links "$WHEELS" $missing \
            >"$OUT_DIR/logs/pip_wheels.log" 2>&1 || echo "[gpu_check] offline wheels for '$missing' failed (see logs/pip_wheels.log)"
    fi
fi

if [ ${#SMOKE[@]} -eq 0 ]; then
    "$PY" tools/gpu_check.py --gpu-present --out "$OUT_DIR" || exit $?
    if timeout 120 "$PY" -m pip install -e . --no-deps --no-build-isolation --no-index >"$OUT_DIR/logs/pip_install.log" 2>&1; then
        export GPU_CHECK_PIP="pip install -e . --no-deps: ok"
    else
        export GPU_CHECK_PIP="pip install -e . --no-deps FAILED (logs/pip_install.log); parts import the checkout from its path"
    fi
else
    export GPU_CHECK_PIP="skipped (smoke run)"
fi
echo "[gpu_check] $GPU_CHECK_PIP"

SPENT=$(( $(date +%s) - START ))
BUDGET=$(( 465 - SPENT ))
[ "$BUDGET" -gt 450 ] && BUDGET=450
"$PY" tools/gpu_check.py "${SMOKE[@]}" --out "$OUT_DIR" --budget "$BUDGET"
