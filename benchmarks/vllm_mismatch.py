"""The same prompts through jetrl's embedded engine and through vLLM, each against the trainer, per strategy.

    python benchmarks/vllm_mismatch.py --model jetrl-tiny --hp-dtype float32 --strategies bf16
    python benchmarks/vllm_mismatch.py --model jetrl-tiny --hp-dtype bfloat16 --strategies bf16,fp8-rollout-rowwise,jet-rowwise

Needs vLLM (on a CPU: the venv scripts/vllm_cpu.sh makes). Prompts: the arithmetic task's, the same for every row.
Prints (and appends to --out) one JSON object per (strategy, engine), with the command that produced it.
"""
import argparse, json, os, platform, shlex, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import torch
from jetrl.rollout import SamplingParams
from jetrl.tasks import get_task
from jetrl.vllm_backend import backend_mismatch_table

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="jetrl-tiny")
    p.add_argument("--hp-dtype", default="bfloat16")
    p.add_argument("--strategies", default="bf16,fp8-rollout-rowwise,jet-rowwise")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="append the JSON lines to this file")
    args = p.parse_args()
    prompts = [row["prompt"] for row in get_task("arithmetic", digits=2, operands=2, operators="+", seed=args.seed).sample(args.prompts)]
    params = SamplingParams(n=args.samples, max_new_tokens=args.new_tokens, seed=args.seed)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    import vllm
    for row in backend_mismatch_table(args.model, args.strategies.split(","), args.hp_dtype, prompts, params):
        row = {"model": args.model, **row, "prompts": args.prompts, "samples": args.samples, "new_tokens": args.new_tokens,
               "cpu": platform.processor() or platform.machine(), "vllm": vllm.__version__, "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": command}
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f: f.write(line + "\n")

if __name__ == "__main__": main()
