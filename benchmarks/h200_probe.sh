#!/usr/bin/env bash
# Session 15's last device minutes: the 1x128 quantizer's formula keeping NaN visible (quantize_groups: a NaN-keeping
# max and clamp, FMNMX.NAN for FMNMX in its SASS) checked on the GPU, and the producers' speed bounds with it.
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:$PWD/tests:${PYTHONPATH:-} PYTHONUNBUFFERED=1
timeout 170 python -m pytest -q -s -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py \
  -k "keep_nan or keeps_nan or producer_quantizers or decode_silu or quantize_gpu_bytes or quantized_is or quantize_1x128" \
  > $OUT/test_gpu_session15_call6.txt 2>&1
grep -E "passed|failed|^FAILED|^ERROR|at decode|one kernel" $OUT/test_gpu_session15_call6.txt | cut -c1-240
