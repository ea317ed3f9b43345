#!/usr/bin/env bash
# Issue 11's check on one H200, in one device call (~9 minutes): the GPU tests first (kernels against the CPU oracle
# and against each other, cuBLAS against the batch-invariant kernel bit for bit and its speed bound, the engine ==
# trainer tests, the graphed trainer and train(cuda_graphs)), then the headline GRPO step side by side (bf16 and jet,
# the GPU's defaults) at the 7B shape and the 0.5B step with the trainer's log-probs from CUDA graphs. Worst case
# 520 s, inside a device call's 600. The 7B step fits one H200 without activation checkpointing (session 14: peak
# 100.5 GB bf16, 108.5 GB jet), so it runs without: each forward once, not twice. With checkpointing, with the old
# log-probs' entropy as jetrl.train computes it, or a default against the code it replaced, in a call of its own:
#   $STEP --model qwen2-7b --prompts 16 --micro-batch 16 [--checkpointing | --entropy [--no-fused-entropy] | --no-dy-producer-quant | --no-gluon-decode]
# The head's log-prob kernels alone: benchmarks/head_logprobs.py.
# The 0.5B step without graphs (session 7: 0.65-0.69x) is `$STEP --model qwen2-0.5b`.
# Results into $OUT (default benchmarks/results). From the repository root on the GPU machine:
#   bash benchmarks/h200_step.sh
# The FP8 linear against torchao is a call of its own (~4 minutes, torchao's blockwise compiles for 150 s):
#   python -m pip install --no-deps wheels/torchao-*.whl && python benchmarks/linear.py --out $OUT/linear_h200.json
set -u
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1     # the device notes' settings
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
# SIGINT at the limit: pytest then stops and still prints its summary and the slowest tests (session 14's run past a
# plain timeout left no summary line)
timeout -s INT -k 20 330 python -m pytest -q -p no:cacheprovider --durations=15 tests/test_gpu.py tests/test_grad_kernels.py \
  -k "not past_2_31" > "$OUT/test_gpu_step.txt" 2>&1
grep -E "passed|failed|KeyboardInterrupt|s call" "$OUT/test_gpu_step.txt" | tail -18
grep -E "^(FAILED|ERROR)" "$OUT/test_gpu_step.txt" | cut -c1-200
STEP="python benchmarks/grpo_step.py --strategies bf16,jet --out $OUT/grpo_step_h200.jsonl"
timeout 110 $STEP --model qwen2-7b --prompts 16 --micro-batch 16 2>&1 | grep "^{" | cut -c1-260
timeout 80 $STEP --model qwen2-0.5b --cuda-graphs 2>&1 | grep "^{" | cut -c1-260
