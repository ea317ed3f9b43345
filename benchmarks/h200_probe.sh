#!/usr/bin/env bash
# Session 17, call 4: the requantizer's default the quads form at 4 warps by 32 columns (call 3's sweep: the fastest at
# all four shapes, 14-18% under 4 x 64); the backward's GPU tests with it, then the steps side by side.
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:$PWD/tests:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1     # the device notes' settings
timeout -s INT -k 20 100 python -m pytest -q -p no:cacheprovider --durations=5 tests/test_grad_kernels.py \
  -k "(requantize or fused_backward or siblings or keep_nan or fast_gemm or one_gradient) and not every_ and not past_2_31" \
  > $OUT/test_gpu_session17_call4.txt 2>&1
grep -E "passed|failed|KeyboardInterrupt" $OUT/test_gpu_session17_call4.txt | tail -3
grep -E "^(FAILED|ERROR)" $OUT/test_gpu_session17_call4.txt | cut -c1-200
STEP="python benchmarks/grpo_step.py --strategies bf16,jet --out $OUT/grpo_step_h200.jsonl"
timeout 110 $STEP --model qwen2-7b --prompts 16 --micro-batch 16 2>&1 | grep "^{" | cut -c1-200
timeout 80 $STEP --model qwen2-0.5b --cuda-graphs 2>&1 | grep "^{" | cut -c1-200
timeout 80 $STEP --model qwen2-0.5b --cuda-graphs 2>&1 | grep "^{" | cut -c1-200
