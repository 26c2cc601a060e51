#!/usr/bin/env bash
# The GPU check in one call: set up Python on a fresh GPU machine from what is installed
# there (no network, no .venv), then run bench/gpu_check.py (the CUDA tests per CUDA path,
# the bitmask kernel, the CUDA paths end to end against a reference engine, n > 1 under CUDA
# graphs, greedy == HF through the Triton path, tensor parallelism with two devices, real
# models when cached; then issue 47's targets on an 8B shape, decode against the HBM bound,
# bench/attention_kernels.py and the kernel comparisons). See bench/gpu_check.py.
#
#   bash bench/gpu_check.sh [--cpu | --dry-run] [gpu_check.py options: --hbm-tbps T --parts a,b ...]
#
# Environment: OUT (the summary goes to $OUT/gpu_check.json, the CUDA tests' log beside it),
# REIN_GPU_CHECK_PYTHON (the interpreter to use), REIN_GPU_CHECK_DEVICE (auto|cuda|cpu; --cpu
# and --dry-run mean cpu: the same Python checks on tiny shapes), REIN_GPU_CHECK_TOTAL (seconds
# for the whole script, default 470: under 8 minutes), REIN_GPU_CHECK_ARCHS (comma-separated:
# greedy_tiny checks only these architectures). Exit status 1 when a part failed.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
START=$(date +%s)
TOTAL="${REIN_GPU_CHECK_TOTAL:-470}"

ARGS=()
for arg in "$@"; do
    case "$arg" in
        --cpu|--dry-run) export REIN_GPU_CHECK_DEVICE=cpu ;;
        *) ARGS+=("$arg") ;;
    esac
done
DEVICE="${REIN_GPU_CHECK_DEVICE:-auto}"

say() { echo "gpu_check.sh: $*"; }

write_fallback() {   # a summary when gpu_check.py could not write one: $1 status, $2 reason
    [ -n "${OUT:-}" ] || return 0
    mkdir -p "$OUT"
    [ -f "$OUT/gpu_check.json" ] && return 0
    REASON="$2" STATUS="$1" "${PY:-python3}" - "$OUT/gpu_check.json" <<'EOF' 2>/dev/null || \
        printf '{"ok": false, "setup_error": "%s"}\n' "$2" > "$OUT/gpu_check.json"
import json, os, sys
json.dump({"ok": False, "status": os.environ["STATUS"], "setup_error": os.environ["REASON"]}, open(sys.argv[1], "w"))
EOF
}

# --- Python: the first interpreter whose torch sees CUDA (any with torch in CPU mode) -------
CANDIDATES=()
[ -n "${REIN_GPU_CHECK_PYTHON:-}" ] && CANDIDATES+=("$REIN_GPU_CHECK_PYTHON")
CANDIDATES+=("$ROOT/.venv/bin/python" python3 python /usr/bin/python3 /usr/local/bin/python3 /opt/conda/bin/python)
PY=""
PY_CPU=""
for candidate in "${CANDIDATES[@]}"; do
    command -v "$candidate" >/dev/null 2>&1 || [ -x "$candidate" ] || continue
    probe=$(timeout 120 "$candidate" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu", torch.__version__)' 2>/dev/null | tail -1)
    case "$probe" in
        cuda\ *) say "$candidate: torch ${probe#cuda } with CUDA"; PY="$candidate"; break ;;
        cpu\ *) say "$candidate: torch ${probe#cpu } without CUDA"; [ -z "$PY_CPU" ] && PY_CPU="$candidate" ;;
        *) say "$candidate: no torch" ;;
    esac
done
if [ -z "$PY" ]; then
    if [ -z "$PY_CPU" ]; then
        say "FAIL no Python here has torch (tried: ${CANDIDATES[*]}); nothing can run"
        write_fallback FAIL "no Python with torch"
        exit 1
    fi
    PY="$PY_CPU"
    if [ "$DEVICE" = "cuda" ]; then
        say "no Python here has torch with CUDA; REIN_GPU_CHECK_DEVICE=cuda: every part will SKIP"
    else
        say "no Python here has torch with CUDA: the CPU mode runs instead (tiny shapes; the GPU parts SKIP)"
        export REIN_GPU_CHECK_DEVICE=cpu
    fi
fi

# --- rein importable: from the working tree (PYTHONPATH), else an offline editable install ----
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PIP_NO_INDEX=1 TQDM_DISABLE=1 \
       PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
INSTALL="not needed (PYTHONPATH=$ROOT)"
if ! "$PY" -c 'import rein' 2>/dev/null; then
    say "rein is not importable from the tree; pip install --no-deps --no-build-isolation -e . (offline)"
    pip_out=$(timeout 120 "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . 2>&1)
    pip_rc=$?
    [ -n "$pip_out" ] && echo "$pip_out" | tail -3
    if [ "$pip_rc" -eq 0 ]; then INSTALL="pip install -e . (offline)"; else INSTALL="pip install -e . failed (rc $pip_rc)"; fi
fi
if ! err=$("$PY" -c 'import rein.engine.engine' 2>&1); then
    say "importing rein.engine fails: $(echo "$err" | tail -1); the parts that need it will FAIL with the reason"
    INSTALL="$INSTALL; rein.engine import failed: $(echo "$err" | tail -1)"
fi

"$PY" - <<'EOF'
import importlib, platform, sys
parts = [f"python {platform.python_version()} ({sys.executable})"]
for name in ("torch", "triton", "transformers", "tokenizers", "safetensors", "gguf", "llguidance", "pytest"):
    try:
        module = importlib.import_module(name)
        parts.append(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as exc:   # noqa: BLE001 - report, do not fail
        parts.append(f"{name} missing ({type(exc).__name__})")
import torch
if torch.cuda.is_available():
    parts.append(f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}, {torch.cuda.device_count()} device(s)")
print("gpu_check.sh: " + "; ".join(parts))
EOF
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.max.sm --format=csv,noheader 2>/dev/null | sed 's/^/gpu_check.sh: nvidia-smi: /'

export REIN_GPU_CHECK_SETUP
REIN_GPU_CHECK_SETUP=$("$PY" -c 'import json, sys, torch; print(json.dumps({"python": sys.executable, "torch": torch.__version__, "cuda": torch.version.cuda, "install": sys.argv[1]}))' "$INSTALL" 2>/dev/null || echo '{}')

# --- the check, inside what is left of the total -------------------------------------------
ELAPSED=$(( $(date +%s) - START ))
LEFT=$(( TOTAL - ELAPSED ))
BUDGET=$(( LEFT - 20 ))
if [ "$BUDGET" -lt 60 ]; then
    say "FAIL only ${LEFT} s left after the setup"
    write_fallback FAIL "setup took ${ELAPSED} s"
    exit 1
fi
say "setup took ${ELAPSED} s; running bench/gpu_check.py with a ${BUDGET} s budget"
timeout --kill-after=10 "$LEFT" "$PY" bench/gpu_check.py --budget "$BUDGET" ${ARGS[@]+"${ARGS[@]}"}
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    say "FAIL bench/gpu_check.py ran past ${LEFT} s and was stopped"
    write_fallback FAIL "bench/gpu_check.py timed out"
fi
say "done in $(( $(date +%s) - START )) s (exit $rc)"
exit "$rc"
