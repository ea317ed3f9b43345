#!/usr/bin/env bash
# The rollout engine on one H200, all in one run: the GPU tests, decode-sized GEMMs, then the grid
# (0.5B with transformers.generate side by side, 7B-shaped), BF16 and FP8 (jet, blockwise) on the same engine.
# Results into $OUT (default benchmarks/results). From the repository root on the GPU machine:
#   bash benchmarks/h200_rollout.sh
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:${PYTHONPATH:-}     # the GPU machine has torch, triton and transformers; jetrl runs from the tree
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
timeout 200 python -m pytest -q tests/test_gpu.py 2>&1 | tail -3 | tee "$OUT/test_gpu_h200.txt"
grep -q " passed" "$OUT/test_gpu_h200.txt" && ! grep -q "failed\|error" "$OUT/test_gpu_h200.txt" || { echo "GPU tests failed: no benchmarks"; exit 1; }
R="--device cuda --batch 64 --prompt-len 128 --new-tokens 256 --reps 3 --out $OUT/rollout_h200.jsonl"
timeout 150 python benchmarks/rollout.py $R --model qwen2-0.5b --strategies bf16,jet --engines graphs,compiled --hf-reps 2 2>&1 | grep "^{" | cut -c1-330
timeout 240 python benchmarks/rollout.py $R --model qwen2-7b --strategies bf16,jet --engines graphs,compiled --no-hf 2>&1 | grep "^{" | cut -c1-330
