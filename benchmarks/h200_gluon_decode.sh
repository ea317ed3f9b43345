#!/usr/bin/env bash
# The overlapped decode GEMM on one H200, each stage under its own timeout (a hang, a barrier never completing, costs
# that stage only). A build per tile and K / 128 % unroll (a few seconds each). From the repository root on the GPU
# machine:
#   OUT=$OUT bash benchmarks/h200_gluon_decode.sh kernel   # ten tiles against jetrl's Triton kernel, then its GPU tests (<= 540 s)
#   OUT=$OUT bash benchmarks/h200_gluon_decode.sh step     # its GPU tests, then the 7B and 0.5B steps with it (the default)
#                                                          # and jet without it (--no-gluon-decode), side by side (<= 520 s)
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1     # the device notes' settings
gpu_tests() {
    timeout 300 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k gluon > "$OUT/test_gpu_gluon.txt" 2>&1
    tail -3 "$OUT/test_gpu_gluon.txt"; grep -E "^(FAILED|ERROR)|us \(" "$OUT/test_gpu_gluon.txt" | cut -c1-200
}
case "${1:-kernel}" in
kernel)
    timeout 240 python benchmarks/gluon_decode_gemm.py --out "$OUT/gluon_decode_gemm_h200.jsonl" 2>&1 | grep -v Warning | tail -14
    gpu_tests ;;
step)
    gpu_tests
    STEP="python benchmarks/grpo_step.py --out $OUT/grpo_step_h200.jsonl"
    SEVEN="--model qwen2-7b --prompts 16 --micro-batch 16 --checkpointing"
    timeout 130 $STEP --strategies bf16,jet $SEVEN 2>&1 | grep "^{" | cut -c1-260
    timeout 90 $STEP --strategies jet --no-gluon-decode $SEVEN 2>&1 | grep "^{" | cut -c1-260
    timeout 80 $STEP --strategies bf16,jet --model qwen2-0.5b --cuda-graphs 2>&1 | grep "^{" | cut -c1-260
    timeout 70 $STEP --strategies jet --no-gluon-decode --model qwen2-0.5b --cuda-graphs 2>&1 | grep "^{" | cut -c1-260 ;;
*) echo "usage: bash benchmarks/h200_gluon_decode.sh kernel|step" >&2; exit 2 ;;
esac
