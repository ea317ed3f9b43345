"""Engine vs trainer on a GPU: how far the rollout's log-probs sit from the trainer's, per strategy and kernel mode.

    python benchmarks/exactness.py --model qwen2-0.5b --prompts 16 --samples 4 --new-tokens 256 \
        --out benchmarks/results/exactness_h200.jsonl

Random-weight model of a real shape (benchmarks/rollout.py), ragged random prompts, sampling at temperature 1, EOS
ignored (every row generates --new-tokens). For each (strategy, mode): the default engine (static cache, CUDA
graphs) generates, the trainer recomputes the same tokens' log-probs (`recompute_log_probs`, no grad), and we report
the mean and max |log p_train - log p_rollout|, the share of tokens with identical log-probs, the gap by token
position, and the rollout's time (median of --reps generations after a warm-up).
"""
import argparse, json, statistics, sys, time
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from rollout import build
from jetrl.policy import Policy
from jetrl.rollout import RolloutEngine, SamplingParams, recompute_log_probs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2-0.5b")
    p.add_argument("--strategies", default="bf16,jet,fp8-rollout")
    p.add_argument("--modes", default="fast,exact")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    command = "python benchmarks/exactness.py " + " ".join(sys.argv[1:] if argv is None else argv)
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
                torch.cuda.synchronize(); t0 = time.perf_counter()
                rollout = engine.generate(prompts, params)
                torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
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
                       rollout_s=statistics.median(times), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                       command=command)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f: f.write(json.dumps(row) + "\n")
            del policy, engine, model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
