#!/usr/bin/env bash
# Issue 11's check on one H200, in one device call (~9 minutes): the GPU tests first (kernels against the CPU oracle
# and against each other, the engine == trainer tests, the speed bounds, the graphed trainer), then the headline GRPO
# step side by side (bf16 and jet, the GPU's default engines) at the 7B and 0.5B shapes, then 0.5B with the trainer's
# log-probs from CUDA graphs if its test passed, then the decode tiles not yet measured (0.5B at 128 and 256 rows, 7B at 256).
# Results into $OUT (default benchmarks/results). From the repository root on the GPU machine:
#   bash benchmarks/h200_step.sh
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1     # the device notes' settings
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 250 python -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_grad_kernels.py > "$OUT/test_gpu_step.txt" 2>&1
tail -5 "$OUT/test_gpu_step.txt"
grep -E "^(FAILED|ERROR)" "$OUT/test_gpu_step.txt" | cut -c1-200
STEP="python benchmarks/grpo_step.py --strategies bf16,jet --out $OUT/grpo_step_h200.jsonl"
timeout 120 $STEP --model qwen2-7b --prompts 16 --micro-batch 16 --checkpointing 2>&1 | grep "^{" | cut -c1-260
timeout 70 $STEP --model qwen2-0.5b 2>&1 | grep "^{" | cut -c1-260
if grep -q " passed" "$OUT/test_gpu_step.txt" && ! grep -E "^(FAILED|ERROR)" "$OUT/test_gpu_step.txt" | grep -q graphed_log_probs; then
  timeout 80 $STEP --model qwen2-0.5b --cuda-graphs 2>&1 | grep "^{" | cut -c1-260
else
  echo "the graphed trainer's test failed or did not finish: no --cuda-graphs step"
fi
TILES="python benchmarks/fp8_gemm_tiles.py --out $OUT/fp8_gemm_tiles_h200.jsonl"   # the 7B shapes at 64 / 128 rows: session 6
timeout 35 $TILES --models qwen2-0.5b --rows 128,256 2>&1 | grep -v "^W"
timeout 35 $TILES --models qwen2-7b --rows 256 2>&1 | grep -v "^W"
