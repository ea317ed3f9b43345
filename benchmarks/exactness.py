"""Engine vs trainer on a GPU: how far the rollout's log-probs sit from the trainer's, per strategy and kernel mode.

    python -m benchmarks exactness --model qwen2-0.5b --prompts 16 --samples 4 --new-tokens 256 \
        --out benchmarks/results/exactness_h200.jsonl

Random-weight model of a real shape (benchmarks/common.py), ragged random prompts, sampling at temperature 1, EOS
ignored (every row generates --new-tokens). For each (strategy, mode): the default engine (static cache, CUDA
graphs) generates, the trainer recomputes the same tokens' log-probs (`recompute_log_probs`, no grad), and we report
the mean and max |log p_train - log p_rollout|, the share of tokens with identical log-probs, the gap by token
position, and the rollout's time (median of --reps generations after a warm-up).
"""
import argparse, statistics
import torch

from benchmarks.common import add_output_args, build, emit, make_row, need_cuda, synced_clock
from jetrl.options import use_kernel_options
from jetrl.policy import Policy
from jetrl.rollout import RolloutEngine, SamplingParams, recompute_log_probs


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks exactness", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2-0.5b")
    p.add_argument("--strategies", default="bf16,jet,fp8-rollout")
    p.add_argument("--modes", default="fast,exact")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--reps", type=int, default=3)
    add_output_args(p)
    args = p.parse_args(argv)
    need_cuda("exactness")
    with use_kernel_options(args.kernels): run(args, argv)


def run(args, argv):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 128, (args.prompts,), generator=g)
    params = SamplingParams(n=args.samples, max_new_tokens=args.new_tokens, seed=0, ignore_eos=True)
    for mode in args.modes.split(","):
        for strategy in args.strategies.split(","):
            model, tokenizer = build(args.model, torch.bfloat16)
            if args.layers: model.model.layers = model.model.layers[:args.layers]
            prompts = [torch.randint(10, model.config.vocab_size, (int(n),), generator=g).tolist() for n in lengths]
            policy = Policy(model, tokenizer, strategy, device="cuda", exact=mode == "exact")
            engine = RolloutEngine(policy, chat_template=False)
            rollout = engine.generate(prompts, params)                                  # warm-up: graphs captured
            times = []
            for _ in range(args.reps):
                t0 = synced_clock("cuda")
                rollout = engine.generate(prompts, params)
                times.append(synced_clock("cuda") - t0)
            trainer = recompute_log_probs(policy.model, rollout, micro_batch_size=16)
            mask = rollout.completion_mask.bool()
            diff = (trainer - rollout.logprobs).abs()
            gap = diff[mask]
            bucket = 64
            by_position = [float(diff[:, i:i + bucket][mask[:, i:i + bucket]].mean()) for i in range(0, args.new_tokens, bucket)]
            row = dict(model=args.model, layers=len(model.model.layers), new_tokens=args.new_tokens, strategy=strategy,
                       mode=mode, tokens=int(mask.sum()), logp_abs_diff_mean=float(gap.mean()),
                       logp_abs_diff_max=float(gap.max()), exact_fraction=float((gap == 0).float().mean()),
                       logp_abs_diff_by_position=dict(bucket=bucket, mean=by_position),
                       rollout_s=statistics.median(times))
            emit(make_row("exactness", row, argv, "cuda"), args.out)
            del policy, engine, model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
