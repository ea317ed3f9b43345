"""Where a decode step's time goes: torch.profiler over one generation, per strategy and engine.

    python benchmarks/profile_rollout.py --model qwen2-0.5b --strategies bf16,jet --engines compiled --new-tokens 32
Prints, per configuration, the CUDA kernels by total time (top --top) and the time per decode step.
"""
import argparse, sys
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from rollout import ENGINES, build                      # noqa: E402  (benchmarks/rollout.py)
from jetrl.policy import Policy                         # noqa: E402
from jetrl.rollout import RolloutEngine, SamplingParams  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2-0.5b")
    p.add_argument("--strategies", default="bf16,jet")
    p.add_argument("--engines", default="compiled")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--top", type=int, default=18)
    args = p.parse_args(argv)
    model, tokenizer = build(args.model, torch.bfloat16)
    model = model.cuda()
    torch.manual_seed(1)
    prompts = torch.randint(10, model.config.vocab_size, (args.batch, args.prompt_len)).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, seed=0, ignore_eos=True)
    for strategy in args.strategies.split(","):
        policy = Policy(model, tokenizer, strategy, device="cuda")
        for engine_name in args.engines.split(","):
            engine = RolloutEngine(policy, chat_template=False, **ENGINES[engine_name])
            engine.generate(prompts, params)                                   # capture / compile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                timing = engine.generate(prompts, params).timing
            print(f"\n== {args.model} {strategy} {engine_name}: decode {1e3 * timing['decode_s'] / args.new_tokens:.3f} ms/step, "
                  f"prefill {1e3 * timing['prefill_s']:.1f} ms", flush=True)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=70), flush=True)


if __name__ == "__main__":
    main()
