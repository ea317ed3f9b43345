"""Long rollouts: decode time against the bytes a step must read, and the engine-vs-trainer gap over every token.

    python -m benchmarks long_rollout --model llama3-8b --rows 64 --new-tokens 4096 --strategies bf16,jet,jet-fp8kv \
        --out benchmarks/results/long_rollout_h200.jsonl

Random-weight model of a real shape (benchmarks/common.py: llama3-8b is Llama-3-8B's), --rows ragged random prompts of
--prompt-min..--prompt-max tokens, sampling at temperature 1 with EOS ignored, so every row generates --new-tokens.
Per strategy, one row: the rollout's time (after a warm-up generation that captures the graphs), its decode step
time, and the bound from the bytes a decode step must read at the GPU's memory bandwidth (`hbm_bytes_per_s`: the
data sheet's, the row's `hbm_tb_per_s`): every weight the step
multiplies by (FP8 or BF16 as the strategy stores it) and the keys and values written so far (each step reads its
row's columns up to the current one), averaged over the steps. Then the trainer recomputes the log-probs of every
generated token (`recompute_log_probs`): the mean |log p_train - log p_rollout| and the share of identical tokens.
`--tiles` sets the attention's tile constants for the run (engine and trainer read the same ones, so a setting
changes the bits of both sides together): one tile setting against the default, same shape, in one process each.
Memory: the peak during the rollout, what was allocated before it (the model in the strategy's precisions, the cache,
and whatever an earlier strategy of the same run still holds: one strategy per process gives a clean peak), and the
cache's own bytes.
"""
import argparse, statistics
import torch
import torch.nn as nn

from benchmarks.attention_decode import attention_tiles, current_tiles, tile_settings
from benchmarks.common import add_output_args, build, emit, hbm_bytes_per_s, make_row, need_cuda, synced_clock
from jetrl.options import use_kernel_options
from jetrl.policy import Policy
from jetrl.rollout import RolloutEngine, SamplingParams, recompute_log_probs


def weight_bytes_per_step(model: nn.Module) -> int:
    "Bytes of the weights one decode step multiplies by: each linear's weight as the rollout stores it (FP8 + scales, or high precision)."
    total = 0
    for m in model.modules():
        recipe = getattr(m, "recipe", None)
        if recipe is not None and recipe.is_fp8("fprop") and hasattr(m, "in_features"):
            total += m.in_features * m.out_features + 4 * -(-m.in_features // 128) * -(-m.out_features // 128)
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total


def kv_bytes_per_column(cache) -> int:
    "Bytes of one row's keys and values at one column, over every layer, as the engine's cache stores them (FP8: + scales)."
    return sum(t[0, :, 0].numel() * t.element_size() for t in [*cache.keys, *cache.values, *cache.key_scales, *cache.value_scales])


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks long_rollout", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--strategies", default="bf16,jet,jet-fp8kv",
                   help="comma-separated; NAME:sdpa runs that strategy's attention by PyTorch's SDPA (the whole cache)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt-min", type=int, default=100)
    p.add_argument("--prompt-max", type=int, default=1000)
    p.add_argument("--new-tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=0, help="keep only the first N layers (0: all)")
    p.add_argument("--no-gap", action="store_true", help="skip the trainer's recomputation (time only)")
    p.add_argument("--tiles", type=tile_settings, default=[current_tiles()], metavar="BLOCK:SPLIT:WARPS:STAGES:FP8_REGISTERS",
                   help="one attention tile setting for the whole run, engine and trainer alike (attention_decode's "
                        "format; default: jetrl's), recorded in each row's `attention_tiles`")
    add_output_args(p)
    args = p.parse_args(argv)
    if len(args.tiles) != 1: raise SystemExit(f"--tiles: one setting per run, got {len(args.tiles)}; run once per setting")
    need_cuda("long_rollout")
    with use_kernel_options(args.kernels), attention_tiles(args.tiles[0]): run(args, argv)


def run(args, argv):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (args.rows,), generator=g)
    params = SamplingParams(max_new_tokens=args.new_tokens, seed=0, ignore_eos=True)
    model, tokenizer = build(args.model, torch.bfloat16)
    if args.layers: model.model.layers = model.model.layers[:args.layers]
    prompts = [torch.randint(10, model.config.vocab_size, (int(n),), generator=g).tolist() for n in lengths]
    bandwidth, bandwidth_source = hbm_bytes_per_s("cuda")
    for name in args.strategies.split(","):
        strategy, _, attention = name.partition(":")
        if attention not in ("", "sdpa"):
            raise SystemExit(f"--strategies: {name!r}: the one attention variant is ':sdpa'")
        policy = Policy(model, tokenizer, strategy, device="cuda")       # re-recipes the same model in place
        if attention == "sdpa": policy.model.jetrl_invariant_attention = False      # PyTorch's SDPA over the whole cache
        engine = RolloutEngine(policy, chat_template=False)
        engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=0, ignore_eos=True))   # graphs captured
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**30      # the model(s), the cache, what earlier strategies left
        t0 = synced_clock("cuda")
        rollout = engine.generate(prompts, params)
        rollout_s = synced_clock("cuda") - t0
        peak = torch.cuda.max_memory_allocated() / 2**30
        cache = engine._static.cache
        steps = args.new_tokens - 1                        # the prefill samples the first token
        decode_step_ms = 1e3 * rollout.timing["decode_s"] / steps
        # the keys a step must read: each row's own prompt and the tokens generated so far (not the left padding)
        longest = int(lengths.max())
        mean_columns = float(lengths.float().mean()) + steps / 2
        bound_ms = 1e3 * (weight_bytes_per_step(policy.rollout_model)
                          + args.rows * mean_columns * kv_bytes_per_column(cache)) / bandwidth
        row = dict(model=args.model, layers=len(model.model.layers), rows=args.rows,
                   prompt_tokens_mean=float(lengths.float().mean()), prompt_tokens_max=longest,
                   new_tokens=args.new_tokens, strategy=strategy, attention="sdpa" if attention == "sdpa" else "jetrl",
                   kv_dtype="fp8" if cache.kv_fp8 else "bf16",
                   kv_bytes_per_token=kv_bytes_per_column(cache),
                   rollout_s=rollout_s, tokens_per_s=args.rows * args.new_tokens / rollout_s,
                   prefill_s=rollout.timing["prefill_s"], decode_step_ms=decode_step_ms, bound_step_ms=bound_ms,
                   step_over_bound=decode_step_ms / bound_ms, hbm_tb_per_s=bandwidth / 1e12,
                   bandwidth_source=bandwidth_source, peak_mem_gb=peak, allocated_before_gb=before,
                   kv_cache_gb=cache.nbytes / 2**30, attention_tiles=current_tiles())
        if not args.no_gap:
            trainer = recompute_log_probs(policy.model, rollout, micro_batch_size=8)
            mask = rollout.completion_mask.bool()
            gap = (trainer - rollout.logprobs).abs()[mask]
            row |= dict(logp_abs_diff_mean=float(gap.mean()), logp_abs_diff_max=float(gap.max()),
                        exact_fraction=float((gap == 0).float().mean()), tokens=int(mask.sum()))
        emit(make_row("long_rollout", row, argv, "cuda"), args.out)
        policy.model.jetrl_invariant_attention = True
        del policy, engine, rollout
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
