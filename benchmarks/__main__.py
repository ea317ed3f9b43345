"""One entry point for every benchmark: `python -m benchmarks` lists them, `python -m benchmarks <name> [options]` runs
one (`--help` after the name for its options). Under torchrun: `torchrun ... -m benchmarks grpo_step --distributed`."""
import importlib, sys

BENCHMARKS = {   # name: (module under benchmarks/, what it measures)
    "grpo_step": ("grpo_step", "the GRPO step phase by phase (rollout, old log-probs, train, sync), per strategy: the headline"),
    "grpo_step_torchrun": ("grpo_step_torchrun", "the same step in one process and under torchrun (FSDP2), same flags"),
    "exactness": ("exactness", "engine vs trainer log-prob gap per strategy and kernel mode (fast / exact)"),
    "rollout": ("rollout", "rollout tokens/s of jetrl's engine against transformers.generate (CPU or GPU)"),
    "long_rollout": ("long_rollout", "long rollouts (4,096+ new tokens): decode step vs its bytes bound, engine-vs-trainer gap"),
    "attention_decode": ("attention_decode", "decode attention at the long-rollout shape per tile setting, BF16 and FP8 KV, vs its bytes bound"),
    "decode_gemm": ("decode_gemm", "decode's FP8 GEMMs at a model's shapes: default tile vs every candidate, cuBLAS BF16/FP8, bytes bound"),
    "linear": ("linear", "a 7B-shaped MLP block forward + backward: BF16 vs jetrl's FP8 recipes vs torchao"),
    "head_logprobs": ("head_logprobs", "the head's per-token log-probs: the fused kernels against torch's ops"),
    "grad_quant": ("grad_quant", "the FP8 backward's quantizer passes at model shapes, time and bytes"),
    "activation_memory": ("activation_memory", "what the trainer's forward keeps for backward, part by part, and the peak"),
    "vllm_mismatch": ("vllm_mismatch", "the same prompts through jetrl's engine and vLLM, each against the trainer"),
    "profile": ("profile_step", "where a step's GPU time goes: top kernels of decode steps and of a training micro-batch"),
    "speed_check": ("speed_check", "the GPU speed bounds (kernels against what they replace), asserted, one row each"),
    "check": ("check", "the whole GPU check: the GPU tests, the kernel tests, then speed_check"),
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "list"):
        width = max(map(len, BENCHMARKS))
        print("python -m benchmarks <name> [options]   (--help after a name for its options)\n")
        for name, (_, what) in BENCHMARKS.items(): print(f"  {name:<{width}}  {what}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        sys.exit(f"unknown benchmark {name!r}; the benchmarks are: {', '.join(BENCHMARKS)}")
    module = importlib.import_module(f"benchmarks.{BENCHMARKS[name][0]}")
    return module.main(rest)


if __name__ == "__main__":
    status = main()
    from jetrl.distributed import exit_rank, launched_by_torchrun
    if launched_by_torchrun(): exit_rank(status if isinstance(status, int) else 0)   # no C++ teardown to abort a finished rank
    sys.exit(status)
