#!/usr/bin/env bash
# Session 16, call 2: the 1x128 quantizers write their scales column-major (cuBLAS's layout: `_fp8_gemm` takes them
# without a copy); the requantizer's narrower tiles (REQUANTIZE_CANDIDATES) swept, their bytes checked at the model
# shapes (every candidate's bytes at ragged shapes: tests/test_grad_kernels.py under the interpreter); then the steps
# side by side. (As run in call 2, 4299eee, the steps took the sweep's pick by a since-removed `--pick-requantize`:
# `{"form":"tile","num_warps":2,"COLS":32}`; measured no better, the default stays, and the steps here take it.)
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:$PWD/tests:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1     # the device notes' settings
# the GPU tests this change touches (~150 s; the whole GPU suite passed in call 1 on the code before it)
TESTS="trainer_gemms or fp8_linear_gpu or invariant_fp8_gemm or gluon or quantize_gpu_bytes or keep_nan or producer"
TESTS="$TESTS or decode_silu or train_with_cuda or graphed_log_probs_equal or compiled_graphed"
TESTS="($TESTS or (test_kernels and (any_strides or quantize_1x128 or quantized or copies)) or test_grad_kernels)"
TESTS="$TESTS and not every_requantize_candidate and not every_launch_candidate and not past_2_31"
timeout -s INT -k 20 160 python -m pytest -q -p no:cacheprovider --durations=8 tests/test_gpu.py tests/test_grad_kernels.py \
  tests/test_kernels.py -k "$TESTS" > $OUT/test_gpu_session16_call2.txt 2>&1
grep -E "passed|failed|KeyboardInterrupt" $OUT/test_gpu_session16_call2.txt | tail -3
grep -E "^(FAILED|ERROR)" $OUT/test_gpu_session16_call2.txt | cut -c1-200
timeout 80 python benchmarks/grad_quant.py --sweep --shapes 896x4864,4864x896,3584x18944,18944x3584 \
  --out $OUT/grad_quant_sweep_session16.jsonl > $OUT/grad_quant_sweep_session16.txt 2>&1
grep -E "requantize|M=|\*" $OUT/grad_quant_sweep_session16.txt | cut -c1-110
STEP="python benchmarks/grpo_step.py --strategies bf16,jet --out $OUT/grpo_step_h200.jsonl"
timeout 110 $STEP --model qwen2-7b --prompts 16 --micro-batch 16 2>&1 | grep "^{" | cut -c1-200
timeout 80 $STEP --model qwen2-0.5b --cuda-graphs 2>&1 | grep "^{" | cut -c1-200
