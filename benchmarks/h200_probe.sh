#!/usr/bin/env bash
# Session 17, call 5 (what the review found not yet run on a GPU with the quads defaults): the backward quantizers
# past 2^31 values (64-bit offsets), their bytes against the old passes and the CPU at model-like shapes, their speed
# bounds, and dy's two passes still faster than the (quads) one pass.
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:$PWD/tests:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1     # the device notes' settings
timeout -s INT -k 10 110 python -m pytest -q -p no:cacheprovider --durations=6 tests/test_gpu.py \
  -k "fused_grad_quantizers or dy_two_passes" > $OUT/test_gpu_session17_call5.txt 2>&1
grep -E "passed|failed|KeyboardInterrupt|s call" $OUT/test_gpu_session17_call5.txt | tail -9
grep -E "^(FAILED|ERROR)|ratio|ms" $OUT/test_gpu_session17_call5.txt | cut -c1-200 | head -20
