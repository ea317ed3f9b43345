#!/usr/bin/env bash
# Session 15's last device call: the SiLU-mul writing the down projection's FP8 copy at decode's rows too, and
# quantize_1x128 / SiLU-mul tiles of 8 rows there (benchmarks/producer_quant.py's verdicts): the GPU tests of bits,
# speed and engine == trainer, then the headline steps side by side.
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:$PWD/tests:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 200 python -m pytest -q -s -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py \
  -k "decode_silu or producer_quantizers or fused_or_not or exact_mode_engine or batch_invariant or silu_mul_quantized or quantize_gpu_bytes" \
  > $OUT/test_gpu_session15_call4.txt 2>&1
grep -E "passed|failed|^FAILED|^ERROR|at decode|max gap" $OUT/test_gpu_session15_call4.txt | cut -c1-240
STEP="python benchmarks/grpo_step.py --strategies bf16,jet --out $OUT/grpo_step_h200.jsonl"
timeout 110 $STEP --model qwen2-7b --prompts 16 --micro-batch 16 2>&1 | grep "^{" | cut -c1-200
timeout 80 $STEP --model qwen2-0.5b --cuda-graphs 2>&1 | grep "^{" | cut -c1-200
