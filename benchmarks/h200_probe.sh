#!/usr/bin/env bash
# Session 17, call 2: the backward quantizers' "quads" form (four tokens packed to a 32-bit word before the transpose;
# now DUAL_LAUNCH and REQUANTIZE_LAUNCH): their bytes on the GPU (tests/test_grad_kernels.py, every launch candidate),
# the sweep of every launch at the 0.5B and 7B shapes, Nsight Compute's counters of the new form, then the steps.
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:$PWD/tests:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1     # the device notes' settings
timeout -s INT -k 20 130 python -m pytest -q -p no:cacheprovider --durations=5 tests/test_grad_kernels.py \
  -k "not past_2_31" > $OUT/test_gpu_session17_call2.txt 2>&1
grep -E "passed|failed|KeyboardInterrupt" $OUT/test_gpu_session17_call2.txt | tail -3
grep -E "^(FAILED|ERROR)" $OUT/test_gpu_session17_call2.txt | cut -c1-200
timeout 100 python benchmarks/grad_quant.py --sweep --shapes 896x4864,4864x896,3584x18944,18944x3584 \
  --out $OUT/grad_quant_sweep_session17.jsonl > $OUT/grad_quant_sweep_session17.txt 2>&1
grep -E "M=|\*|quads|passes" $OUT/grad_quant_sweep_session17.txt | cut -c1-110
timeout 60 /usr/local/cuda/bin/ncu --clock-control none --profile-from-start off --set full --page details \
  --print-units base python benchmarks/ncu_kernels.py --kernels requantize,quantize_dual > $OUT/ncu_quads_h200_session17.txt 2>&1
grep -E "^  [a-z_]+.*\(|Duration|Registers Per|Achieved Occupancy|bank" $OUT/ncu_quads_h200_session17.txt | cut -c1-110 | head -60
STEP="python benchmarks/grpo_step.py --strategies bf16,jet --out $OUT/grpo_step_h200.jsonl"
timeout 110 $STEP --model qwen2-7b --prompts 16 --micro-batch 16 2>&1 | grep "^{" | cut -c1-200
timeout 80 $STEP --model qwen2-0.5b --cuda-graphs 2>&1 | grep "^{" | cut -c1-200
