#!/usr/bin/env bash
# The overlapped decode GEMM's first measurement on one H200, in one device call (worst case 560 s): the kernel alone
# against jetrl's Triton kernel (bits and time at the 0.5B and 7B decode shapes), its GPU tests (bits, engine ==
# trainer, its speed bound), then the 7B and 0.5B GRPO steps with it (`--gluon-decode`; the default's numbers are
# h200_step.sh's). Each stage under its own timeout: a hang (a barrier never completing) costs that stage only.
# From the repository root on the GPU machine:  OUT=$OUT bash benchmarks/h200_gluon_decode.sh
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1     # the device notes' settings
timeout 180 python benchmarks/gluon_decode_gemm.py --out "$OUT/gluon_decode_gemm_h200.jsonl" 2>&1 | grep -v Warning | tail -12
timeout 160 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k gluon > "$OUT/test_gpu_gluon.txt" 2>&1
tail -3 "$OUT/test_gpu_gluon.txt"; grep -E "^(FAILED|ERROR)|us \(" "$OUT/test_gpu_gluon.txt" | cut -c1-200
STEP="python benchmarks/grpo_step.py --strategies bf16,jet --out $OUT/grpo_step_h200.jsonl --gluon-decode"
timeout 130 $STEP --model qwen2-7b --prompts 16 --micro-batch 16 --checkpointing 2>&1 | grep "^{" | cut -c1-260
timeout 90 $STEP --model qwen2-0.5b --cuda-graphs 2>&1 | grep "^{" | cut -c1-260
