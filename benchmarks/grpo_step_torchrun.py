"""The GRPO step at one shape in one process and under `torchrun` (FSDP2 over the ranks), same flags, one file.

    python -m benchmarks grpo_step_torchrun --out benchmarks/results/grpo_step_h200_torchrun.jsonl
    python -m benchmarks grpo_step_torchrun --steps 1 --strategies bf16,jet --parts torchrun

Runs `python -m benchmarks grpo_step` then `torchrun --standalone --nproc-per-node N -m benchmarks grpo_step
--distributed` with the same shape (default the 7B rows of grpo_step_h200.jsonl with activation checkpointing). Their
rows carry `launcher` ("single" / "torchrun"), `gpus`, `sync_bytes` and `sync_format`; the torchrun rows also one weight
sync in the other wire format (`sync_s_hp`, `sync_bytes_hp`: gathered in high precision, quantized after). On one GPU
the torchrun rows should be within 5% of the single rows' step_s: the wrapper costs nothing when there is nothing to
shard. Other grpo_step options (e.g. --kernels) follow `--`.
"""
import argparse, os, subprocess, sys

SHAPE = ["--model", "qwen2-7b", "--prompts", "16", "--samples", "8", "--prompt-len", "128", "--new-tokens", "512",
         "--micro-batch", "16", "--checkpointing"]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks grpo_step_torchrun", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2, help="timed steps per strategy, after one warm-up step")
    p.add_argument("--strategies", default="bf16,fp8-rollout,jet")
    p.add_argument("--parts", default="single,torchrun", help="comma-separated: single, torchrun")
    p.add_argument("--nproc", type=int, default=1, help="torchrun's processes (GPUs)")
    p.add_argument("--out", "--results", dest="out", default=None, metavar="FILE", help="append the rows to FILE")
    p.add_argument("rest", nargs="*", help="more grpo_step options, after --")
    args = p.parse_args(argv)
    common = SHAPE + ["--steps", str(args.steps), "--strategies", args.strategies] + args.rest
    if args.out: common += ["--out", args.out]
    # the same trainer on both sides: eager (graphs replay kernels, not FSDP's hooks)
    commands = {"single": [sys.executable, "-m", "benchmarks", "grpo_step", "--no-cuda-graphs", *common],
                "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(args.nproc), "-m", "benchmarks", "grpo_step", "--distributed", *common]}
    for part in args.parts.split(","):
        if part not in commands: p.error(f"unknown part {part!r}: single or torchrun")
        subprocess.run(commands[part], check=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
