#!/usr/bin/env bash
# The distributed path on one GPU (issue 16): the GRPO step at the 7B shape in one process and under
# `torchrun --nproc-per-node 1` (NCCL, FSDP2 over one rank), same flags, rows appended to one file with
# `launcher` ("single" / "torchrun"), `gpus`, `sync_bytes`, `sync_format` and the command. The torchrun rows should
# be within 5% of the single rows' step_s (the wrapper costs nothing when there is nothing to shard).
# Run from the repository root on one H200 (each command a few minutes):
#   bash benchmarks/grpo_step_torchrun.sh            # or one PART at a time: PART=single|torchrun|hp bash ...
set -euo pipefail
OUT=${OUT:-benchmarks/results/grpo_step_h200_torchrun.jsonl}
SHAPE="--model qwen2-7b --prompts 16 --samples 8 --prompt-len 128 --new-tokens 512 --micro-batch 4 --checkpointing"
PART=${PART:-all}
if [[ $PART == all || $PART == single ]]; then
  python benchmarks/grpo_step.py $SHAPE --strategies bf16,fp8-rollout,jet --out "$OUT"
fi
if [[ $PART == all || $PART == torchrun ]]; then
  torchrun --standalone --nproc-per-node 1 benchmarks/grpo_step.py --distributed $SHAPE --strategies bf16,fp8-rollout,jet --out "$OUT"
fi
if [[ $PART == all || $PART == hp ]]; then   # the weight sync gathered in high precision and quantized after, for sync_bytes / sync_s
  torchrun --standalone --nproc-per-node 1 benchmarks/grpo_step.py --distributed --sync-format hp $SHAPE --strategies jet --out "$OUT"
fi
