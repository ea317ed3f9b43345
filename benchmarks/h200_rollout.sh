#!/usr/bin/env bash
# The rollout engine on one H200: GPU tests, then the benchmark grid, results into $OUT (or benchmarks/results).
# Run from the repository root on the GPU machine:  bash benchmarks/h200_rollout.sh
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:${PYTHONPATH:-}     # the GPU machine has torch and transformers; jetrl runs from the tree
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
[ -n "${SKIP_TESTS:-}" ] || timeout 240 python -m pytest -q tests/test_gpu.py 2>&1 | tail -25 | tee "$OUT/test_gpu_h200.txt"
R="--device cuda --batch 64 --prompt-len 128 --new-tokens 256 --reps 3"
timeout 200 python benchmarks/rollout.py $R --model qwen2-0.5b --strategies bf16,jet --engines graphs,eager --hf-reps 1 --out "$OUT/rollout_h200.jsonl" 2>&1 | grep -v Warning
timeout 150 python benchmarks/rollout.py $R --model qwen2-7b --strategies bf16,jet --engines graphs --no-hf --out "$OUT/rollout_h200.jsonl" 2>&1 | grep -v Warning
timeout 200 python benchmarks/rollout.py $R --model qwen2-0.5b --strategies bf16,jet --engines compiled --no-hf --out "$OUT/rollout_h200.jsonl" 2>&1 | grep -v Warning | tail -4
