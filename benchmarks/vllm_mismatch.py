"""The same prompts through jetrl's embedded engine and through vLLM, each against the trainer, per strategy.

    python -m benchmarks vllm_mismatch --model jetrl-tiny --hp-dtype float32 --strategies bf16
    python -m benchmarks vllm_mismatch --model jetrl-tiny --hp-dtype bfloat16 --strategies bf16,fp8-rollout-rowwise,jet-rowwise

Needs vLLM (on a CPU: the venv scripts/vllm_cpu.sh makes). Prompts: the arithmetic task's, the same for every row.
One row per (strategy, engine), with the vLLM version and the CPU.
"""
import argparse, os, platform
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from benchmarks.common import add_output_args, emit, make_row
from jetrl.rollout import SamplingParams
from jetrl.tasks import get_task
from jetrl.vllm_backend import backend_mismatch_table

def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks vllm_mismatch", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="jetrl-tiny")
    p.add_argument("--hp-dtype", default="bfloat16")
    p.add_argument("--strategies", default="bf16,fp8-rollout-rowwise,jet-rowwise")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    add_output_args(p, kernels=False)
    args = p.parse_args(argv)
    prompts = [row["prompt"] for row in get_task("arithmetic", digits=2, operands=2, operators="+", seed=args.seed).sample(args.prompts)]
    params = SamplingParams(n=args.samples, max_new_tokens=args.new_tokens, seed=args.seed)
    import vllm
    for row in backend_mismatch_table(args.model, args.strategies.split(","), args.hp_dtype, prompts, params):
        row = {"model": args.model, **row, "prompts": args.prompts, "samples": args.samples, "new_tokens": args.new_tokens,
               "cpu": platform.processor() or platform.machine(), "vllm": vllm.__version__}
        emit(make_row("vllm_mismatch", row, argv, "cpu"), args.out)

if __name__ == "__main__": main()
