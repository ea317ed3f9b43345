"""Rollout throughput: jetrl's engine vs `transformers.generate`, same model, same settings, one run.

    python -m benchmarks rollout --device cpu --model jetrl-tiny --batch 32 --prompt-len 32 --new-tokens 64
    python -m benchmarks rollout --model smollm2-135m --batch 16 --prompt-len 64 --new-tokens 64
    python -m benchmarks rollout --device cuda --model qwen2-0.5b --batch 64 --prompt-len 128 --new-tokens 256 \
        --strategies bf16,jet --engines graphs,eager

Workloads (--workload):
  fixed: prompts are random token ids of one length; both sides sample (temperature 1, no truncation) and
         ignore EOS, so both generate exactly batch x new-tokens tokens: the raw decode speed.
  rl:    GRPO's shape on jetrl-tiny: --batch task prompts (the easy level) x --samples completions each,
         EOS on; throughput counts the tokens each side really generated (pads excluded). The engine prefills
         each prompt once and drops finished rows; transformers expands the prompts and decodes every row
         until the last one ends.
Engines (--engines, comma-separated; each is measured against the same transformers.generate run):
  graphs:   static KV cache, CUDA graphs on a GPU (the default engine)
  compiled: static KV cache, step compiled by torch.compile, then CUDA graphs
  eager:    static KV cache, no graphs (the CPU path)
  dynamic:  transformers' own forward with a DynamicCache
Strategies (--strategies, comma-separated) run one after the other on the same model: e.g. bf16,jet.
Prints one JSON object per (strategy, engine).
"""
import argparse, statistics, time
import torch

from benchmarks.common import RANDOM_MODELS, add_output_args, build, emit, make_row, synced_clock
from jetrl.options import use_kernel_options
from jetrl.policy import Policy
from jetrl.rollout import RolloutEngine, SamplingParams


def tokens_per_s(fn, reps: int, device) -> tuple[float, int]:
    "Median over `reps` of (tokens fn() generated) / seconds; and the tokens of the last call."
    rates = []
    for _ in range(reps):
        t0 = synced_clock(device); tokens = fn()
        rates.append(tokens / (synced_clock(device) - t0))
    return statistics.median(rates), tokens


ENGINES = {"graphs": dict(cuda_graphs=True), "compiled": dict(cuda_graphs=True, compile=True),
           "eager": dict(cuda_graphs=False), "dynamic": dict(cache_implementation="dynamic")}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks rollout", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="jetrl-tiny", help="jetrl-tiny, smollm2-135m, a local folder, or " + ", ".join(RANDOM_MODELS))
    p.add_argument("--strategies", default="bf16", help="comma-separated, run in this order on one model")
    p.add_argument("--engines", default="graphs", help="comma-separated: " + ", ".join(ENGINES))
    p.add_argument("--no-hf", action="store_true", help="skip the transformers.generate baseline")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--hf-reps", type=int, default=0, help="repetitions of the baseline (0: as --reps)")
    p.add_argument("--workload", default="fixed", choices=["fixed", "rl"])
    p.add_argument("--samples", type=int, default=8, help="completions per prompt (rl workload)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    add_output_args(p)
    args = p.parse_args(argv)
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown: p.error(f"unknown engine(s) {sorted(unknown)}: choose from {sorted(ENGINES)}")
    if args.threads: torch.set_num_threads(args.threads)
    with use_kernel_options(args.kernels): run(args, argv)


def run(args, argv):
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tokenizer = build(args.model, dtype)
    model = model.to(device)
    vocab = model.config.vocab_size
    torch.manual_seed(1)
    if args.workload == "fixed":
        prompts = torch.randint(10, vocab, (args.batch, args.prompt_len)).tolist()
        params = SamplingParams(max_new_tokens=args.new_tokens, seed=0, ignore_eos=True)
        hf_inputs = tokenizer.pad({"input_ids": prompts}, return_tensors="pt", padding_side="left")
        hf_extra = dict(min_new_tokens=args.new_tokens)
    else:
        from jetrl.tiny import level_rows
        prompts = [r["prompt"] for r in level_rows("easy", args.batch)]
        params = SamplingParams(n=args.samples, max_new_tokens=args.new_tokens, seed=0)
        hf_inputs = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
        hf_extra = dict(num_return_sequences=args.samples)
    hf_inputs = {k: v.to(device) for k, v in hf_inputs.items()}
    probe = RolloutEngine(model, tokenizer, chat_template=False, cache_implementation="dynamic")
    eos, pad_id = set(probe.eos_ids), probe.pad_id

    @torch.no_grad()
    def run_hf():                                              # the untouched model: nothing of jetrl in the loop
        out = model.generate(**hf_inputs, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new_tokens,
                             pad_token_id=pad_id, **hf_extra)[:, hf_inputs["input_ids"].shape[1]:]
        generated = 0
        for row in out.tolist():                               # tokens up to and including the first EOS
            ends = [i for i, t in enumerate(row) if t in eos]
            generated += (ends[0] + 1) if ends and args.workload == "rl" else len(row)
        return generated
    hf_tps = None
    if not args.no_hf:
        run_hf()                                               # warm-up
        hf_tps, _ = tokens_per_s(run_hf, args.hf_reps or args.reps, device)

    for strategy in args.strategies.split(","):
        policy = Policy(model, tokenizer, strategy, device=device)        # re-recipes the same model in place
        for engine_name in args.engines.split(","):
            engine = RolloutEngine(policy, chat_template=False, **ENGINES[engine_name])
            run_engine = lambda: int(engine.generate(prompts, params).completion_mask.sum())
            t0 = time.perf_counter(); run_engine(); warmup_s = time.perf_counter() - t0       # captures / compiles here
            engine_tps, tokens = tokens_per_s(run_engine, args.reps, device)
            last = engine.generate(prompts, params).timing
            row = dict(model=args.model, strategy=strategy, engine=engine_name, cache=engine.cache_implementation,
                       workload=args.workload, device=str(device), dtype=str(dtype).removeprefix("torch."), batch=args.batch,
                       samples=args.samples if args.workload == "rl" else 1, prompt_len=args.prompt_len,
                       new_tokens=args.new_tokens, engine_tokens=tokens, engine_tokens_per_s=round(engine_tps, 1),
                       prefill_ms=round(1e3 * last["prefill_s"], 2),
                       decode_ms_per_step=round(1e3 * last["decode_s"] / args.new_tokens, 3),
                       warmup_s=round(warmup_s, 1),
                       hf_tokens_per_s=None if hf_tps is None else round(hf_tps, 1),
                       speedup_vs_hf=None if hf_tps is None else round(engine_tps / hf_tps, 2),
                       threads=torch.get_num_threads())
            emit(make_row("rollout", row, argv, device), args.out)
            del engine
            if device.type == "cuda": torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
