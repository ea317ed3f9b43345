#!/usr/bin/env bash
# The distributed path on one GPU (issue 16): the GRPO step at the 7B shape, per strategy, in one process and under
# `torchrun --nproc-per-node 1` (NCCL, FSDP2 over one rank), same flags, in one call. Rows are appended to one file with
# `launcher` ("single" / "torchrun"), `gpus`, `sync_bytes`, `sync_format` and the command; the torchrun rows also carry
# one weight sync in the other wire format (`sync_s_hp`, `sync_bytes_hp`: gathered in high precision, quantized after).
# The torchrun rows should be within 5% of the single rows' step_s (the wrapper costs nothing when there is nothing to
# shard). The shape is the one of the 7B rows in grpo_step_h200.jsonl (micro-batch 16, activation checkpointing).
# Run from the repository root on one H200:
#   bash benchmarks/grpo_step_torchrun.sh                 # ~6 min with STEPS=2 (see the estimate in the closing note)
#   STEPS=1 PART=single bash benchmarks/grpo_step_torchrun.sh    # one launcher only: PART=single|torchrun
set -euo pipefail
OUT=${OUT:-benchmarks/results/grpo_step_h200_torchrun.jsonl}
STEPS=${STEPS:-2}                # timed steps per strategy, after one warm-up step
STRATEGIES=${STRATEGIES:-bf16,fp8-rollout,jet}
SHAPE="--model qwen2-7b --prompts 16 --samples 8 --prompt-len 128 --new-tokens 512 --micro-batch 16 --checkpointing --steps $STEPS"
PART=${PART:-all}
if [[ $PART == all || $PART == single ]]; then
  python benchmarks/grpo_step.py $SHAPE --strategies "$STRATEGIES" --out "$OUT"
fi
if [[ $PART == all || $PART == torchrun ]]; then
  torchrun --standalone --nproc-per-node 1 benchmarks/grpo_step.py --distributed $SHAPE --strategies "$STRATEGIES" --out "$OUT"
fi
