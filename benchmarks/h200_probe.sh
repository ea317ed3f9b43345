#!/usr/bin/env bash
# Session 15's last device call: the headline steps again with the final code (a second sample of each ratio; the
# 0.5B step twice, the one nearest its target).
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
STEP="python benchmarks/grpo_step.py --strategies bf16,jet --out $OUT/grpo_step_h200.jsonl"
timeout 80 $STEP --model qwen2-0.5b --cuda-graphs 2>&1 | grep "^{" | cut -c1-200
timeout 110 $STEP --model qwen2-7b --prompts 16 --micro-batch 16 2>&1 | grep "^{" | cut -c1-200
timeout 80 $STEP --model qwen2-0.5b --cuda-graphs 2>&1 | grep "^{" | cut -c1-200
