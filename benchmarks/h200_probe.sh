#!/usr/bin/env bash
# Session 14's first device call: wider decode strips for the Triton FP8 GEMM, the 7B step without checkpointing,
# and where the 0.5B jet micro-batch spends its time. Results into $OUT.
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEP="python benchmarks/grpo_step.py --strategies bf16,jet --out $OUT/grpo_step_h200.jsonl"
timeout 140 $STEP --model qwen2-7b --prompts 16 --micro-batch 16 2>&1 | grep "^{" | cut -c1-330
timeout 90 python benchmarks/profile_step.py --model qwen2-0.5b --train-only --cuda-graphs --top 40 > $OUT/profile_train_05b_h200_session14.txt 2>&1; grep "#####" $OUT/profile_train_05b_h200_session14.txt
timeout 130 python benchmarks/fp8_gemm_tiles.py --models qwen2-7b --rows 128 --linears gate+up,qkv --decode-block-n 64,128,256 --decode-warps 4,8 --decode-stages 3,4 --out $OUT/fp8_gemm_tiles_wide_h200.jsonl 2>&1 | grep -v Warn | tail -8
timeout 80 python benchmarks/fp8_gemm_tiles.py --models qwen2-0.5b --rows 256 --linears gate+up,qkv --decode-block-n 64,128,256 --decode-warps 4,8 --decode-stages 3,4 --out $OUT/fp8_gemm_tiles_wide_h200.jsonl 2>&1 | grep -v Warn | tail -8
timeout 100 $STEP --model qwen2-0.5b --cuda-graphs --micro-batch 32 2>&1 | grep "^{" | cut -c1-330
