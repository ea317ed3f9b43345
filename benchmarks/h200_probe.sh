#!/usr/bin/env bash
# Session 14's third device call: the GPU tests of this session's changes (the weight quantizer's bits and speed, the
# graphed trainer across updates with Dgrad's pinned copy), the 0.5B and 7B steps with the final code, and the 7B
# step with the trainer from CUDA graphs. Results into $OUT.
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 200 python -m pytest -q -s -p no:cacheprovider tests/test_gpu.py -k "weight_quantizer or graphed or cuda_graph or train_with_cuda" > $OUT/test_gpu_session14_call3.txt 2>&1
grep -E "passed|failed|^FAILED|^ERROR|kernel .* us" $OUT/test_gpu_session14_call3.txt | cut -c1-220
STEP="python benchmarks/grpo_step.py --strategies bf16,jet --out $OUT/grpo_step_h200.jsonl"
timeout 80 $STEP --model qwen2-0.5b --cuda-graphs 2>&1 | grep "^{" | cut -c1-200
timeout 110 $STEP --model qwen2-7b --prompts 16 --micro-batch 16 2>&1 | grep "^{" | cut -c1-200
timeout 150 $STEP --model qwen2-7b --prompts 16 --micro-batch 16 --cuda-graphs 2>&1 | grep -E "^\{|Error" | cut -c1-200
