#!/usr/bin/env bash
# The rollout engine on one H200: GPU tests, then the benchmark grid; results into $OUT (default
# benchmarks/results). Run from the repository root on the GPU machine:
#   bash benchmarks/h200_rollout.sh            # tests, 0.5B grid (with transformers.generate), profile
#   PART=7b bash benchmarks/h200_rollout.sh    # the 7B-shaped grid
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:${PYTHONPATH:-}     # the GPU machine has torch and transformers; jetrl runs from the tree
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
R="--device cuda --batch 64 --prompt-len 128 --new-tokens 256 --reps 3 --out $OUT/rollout_h200.jsonl"
if [ "${PART:-0.5b}" = "7b" ]; then
  timeout 420 python benchmarks/rollout.py $R --model qwen2-7b --strategies bf16,jet --engines graphs,compiled --no-hf 2>&1 | grep "^{"
  exit
fi
timeout 240 python -m pytest -q tests/test_gpu.py 2>&1 | tail -4 | tee "$OUT/test_gpu_h200.txt"
timeout 240 python benchmarks/rollout.py $R --model qwen2-0.5b --strategies bf16,jet --engines graphs,compiled --hf-reps 2 2>&1 | grep "^{"
timeout 90 python benchmarks/profile_rollout.py --model qwen2-0.5b --strategies jet --engines compiled --new-tokens 16 --top 14 \
  2>&1 | grep -v "Warning\|warn" | cut -c1-72,150-200 > "$OUT/profile_rollout_h200.txt"
