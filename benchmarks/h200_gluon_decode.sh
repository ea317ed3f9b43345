#!/usr/bin/env bash
# The overlapped decode GEMM's first measurement on one H200, in two device calls, each stage under its own timeout (a
# hang, a barrier never completing, costs that stage only). Each K is a build of its own: ~3 s, ~40 s for the 7B down
# projection's 148 blocks (cached on disk for the next stage). From the repository root on the GPU machine:
#   OUT=$OUT bash benchmarks/h200_gluon_decode.sh kernel   # the kernel against jetrl's Triton kernel, then its GPU tests (<= 540 s)
#   OUT=$OUT bash benchmarks/h200_gluon_decode.sh step     # the 7B and 0.5B GRPO steps with --gluon-decode (<= 330 s)
# The default's step numbers to compare with come from h200_step.sh (or a run without --gluon-decode in the same call).
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1     # the device notes' settings
case "${1:-kernel}" in
kernel)
    timeout 240 python benchmarks/gluon_decode_gemm.py --out "$OUT/gluon_decode_gemm_h200.jsonl" 2>&1 | grep -v Warning | tail -14
    timeout 300 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k gluon > "$OUT/test_gpu_gluon.txt" 2>&1
    tail -3 "$OUT/test_gpu_gluon.txt"; grep -E "^(FAILED|ERROR)|us \(" "$OUT/test_gpu_gluon.txt" | cut -c1-200 ;;
step)
    STEP="python benchmarks/grpo_step.py --strategies bf16,jet --out $OUT/grpo_step_h200.jsonl --gluon-decode"
    timeout 180 $STEP --model qwen2-7b --prompts 16 --micro-batch 16 --checkpointing 2>&1 | grep "^{" | cut -c1-260
    timeout 150 $STEP --model qwen2-0.5b --cuda-graphs 2>&1 | grep "^{" | cut -c1-260 ;;
*) echo "usage: bash benchmarks/h200_gluon_decode.sh kernel|step" >&2; exit 2 ;;
esac
