#!/usr/bin/env bash
# Session 17, call 1: session 16's code not yet run on a GPU (the backward quantizers' NaN rule, fast_if_same_bits'
# NaN rule, `_fp8_gemm`'s one-copy padding, the requantizer's COLS check), then Nsight Compute's counters of the
# quantizer passes and the 7B decode GEMMs (benchmarks/ncu_kernels.py: what bounds each), then the 7B step.
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:$PWD/tests:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1     # the device notes' settings
TESTS="(test_grad_kernels and not every_requantize_candidate and not every_launch_candidate and not past_2_31)"
TESTS="$TESTS or without_a_copy or keep_nan or many_row_fp8_gemm or graphed_log_probs_pad or fp8_linear_gpu"
timeout -s INT -k 20 170 python -m pytest -q -p no:cacheprovider --durations=8 tests/test_grad_kernels.py tests/test_gpu.py \
  -k "$TESTS" > $OUT/test_gpu_session17_call1.txt 2>&1
grep -E "passed|failed|KeyboardInterrupt" $OUT/test_gpu_session17_call1.txt | tail -3
grep -E "^(FAILED|ERROR)" $OUT/test_gpu_session17_call1.txt | cut -c1-200
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
echo "ncu: $NCU"
timeout 170 $NCU --clock-control none --profile-from-start off --set full --page details --print-units base \
  python benchmarks/ncu_kernels.py > $OUT/ncu_kernels_h200.txt 2>&1
echo "ncu rc=$? lines=$(wc -l < $OUT/ncu_kernels_h200.txt)"
grep -E "^  [a-z_]+.*\(|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy" \
  $OUT/ncu_kernels_h200.txt | cut -c1-120 | head -120
STEP="python benchmarks/grpo_step.py --strategies bf16,jet --out $OUT/grpo_step_h200.jsonl"
timeout 110 $STEP --model qwen2-7b --prompts 16 --micro-batch 16 2>&1 | grep "^{" | cut -c1-200
