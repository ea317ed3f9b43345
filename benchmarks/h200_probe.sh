#!/usr/bin/env bash
# Session 17, call 3: the requantizer's default now the quads form at 4 warps by 64 columns (call 2's sweep: 23-29%
# less GPU time than the tile form at every shape), with more narrow quads launches swept; where a 7B jet micro-batch's
# GPU time goes now; then the steps (0.5B twice: its ratio sits within the runs' noise of 1.0).
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:$PWD/tests:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1     # the device notes' settings
timeout 100 python benchmarks/grad_quant.py --sweep --shapes 896x4864,4864x896,3584x18944,18944x3584 \
  --out $OUT/grad_quant_sweep_session17_call3.jsonl > $OUT/grad_quant_sweep_session17_call3.txt 2>&1
grep -E "M=|\*|quads.*COLS" $OUT/grad_quant_sweep_session17_call3.txt | cut -c1-110
STEP="python benchmarks/grpo_step.py --strategies bf16,jet --out $OUT/grpo_step_h200.jsonl"
timeout 80 $STEP --model qwen2-0.5b --cuda-graphs 2>&1 | grep "^{" | cut -c1-200
timeout 110 $STEP --model qwen2-7b --prompts 16 --micro-batch 16 2>&1 | grep "^{" | cut -c1-200
timeout 80 $STEP --model qwen2-0.5b --cuda-graphs 2>&1 | grep "^{" | cut -c1-200
timeout 120 python benchmarks/profile_step.py --model qwen2-7b --strategies jet --train-only --top 30 \
  > $OUT/profile_train_7b_h200_session17.txt 2>&1
grep -E "#####|ms " $OUT/profile_train_7b_h200_session17.txt | head -34 | cut -c1-150
