"""What FSDP2 over one rank costs the GRPO step, phase by phase: one process holding both launch paths, steps alternated.

    torchrun --standalone --nproc-per-node 1 benchmarks/grpo_step_overhead.py --model qwen2-0.5b --strategy jet \
        --prompts 32 --samples 8 --new-tokens 512 --micro-batch 16 --pairs 3 --profile

Under a 1-rank torchrun launch this builds the same model twice (same seed): a single-process policy (what
`python benchmarks/grpo_step.py` times) and one sharded as `torchrun ... grpo_step.py --distributed` shards it (FSDP2,
its own rollout copy, the distributed weight sync). It runs their steps alternately (A B B A ...), so both see the same
machine state, and prints each path's median phase times, the median per-pair ratio sharded / single, and how many
times each phase quantized a weight (the regression of issue 16: the sharded path's old log-probs re-quantized every
weight in every micro-batch). With --profile, the ops (CPU and GPU) whose count or time differ most between the two
paths over the last pair's steps. Both models must fit at once: 0.5B yes, 7B no.
Runs on the CPU too (gloo), e.g. `--model jetrl-tiny --prompts 8 --samples 4 --prompt-len 16 --new-tokens 8 --micro-batch 2`.
"""
import argparse, collections, json, statistics, sys
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import grpo_step                                                   # benchmarks/grpo_step.py: the timed step
from rollout import build                                          # benchmarks/rollout.py: the random model shapes
import jetrl.distributed as jd, jetrl.linear as jl
from jetrl.policy import Policy
from jetrl.rollout import RolloutEngine, SamplingParams

PHASES = ("rollout_s", "old_logp_s", "train_s", "sync_s", "step_s")


def count_weight_quantizations():
    """Count calls of the weight quantizers (one process's and the sharded sync's) by the phase `grpo_step` is in;
    returns the counter and `in_phase(fn, label)`, which labels the calls made inside fn."""
    counts, phase = collections.Counter(), ["other"]
    def counted(module, name):
        fn = getattr(module, name)
        def wrapper(*args, **kwargs): counts[phase[0]] += 1; return fn(*args, **kwargs)
        setattr(module, name, wrapper)
    for module, name in ((jl, "quantize_weight"), (jd, "quantize_weight"), (jd, "quantize_row_shard")): counted(module, name)
    def in_phase(fn, label):
        def wrapper(*args, **kwargs):
            previous, phase[0] = phase[0], label
            try: return fn(*args, **kwargs)
            finally: phase[0] = previous
        return wrapper
    grpo_step.recompute_log_probs = in_phase(grpo_step.recompute_log_probs, "old_logp")
    grpo_step.token_log_probs = in_phase(grpo_step.token_log_probs, "train")
    return counts, in_phase


def op_table(prof) -> dict:
    "name -> (calls, CPU ms, device ms) of a profile."
    return {e.key: (e.count, e.cpu_time_total / 1e3, getattr(e, "device_time_total", 0.0) / 1e3) for e in prof.key_averages()}


def largest_differences(single: dict, sharded: dict, n: int) -> list[str]:
    rows = []
    for name in set(single) | set(sharded):
        (c1, cpu1, dev1), (c2, cpu2, dev2) = single.get(name, (0, 0.0, 0.0)), sharded.get(name, (0, 0.0, 0.0))
        rows.append((abs(cpu2 - cpu1) + abs(dev2 - dev1), f"{name[:60]:60s} calls {c1:6d} -> {c2:6d}   cpu ms {cpu1:9.1f} -> "
                                                              f"{cpu2:9.1f}   device ms {dev1:9.1f} -> {dev2:9.1f}"))
    return [line for _, line in sorted(rows, reverse=True)[:n]]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2-0.5b")
    p.add_argument("--strategy", default="jet")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--pairs", type=int, default=3, help="timed (single, sharded) step pairs after one warm-up step each")
    p.add_argument("--profile", action="store_true", help="profile the last pair's old log-probs and training phases")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    world = jd.init_world()
    if world.size != 1: raise SystemExit("Launch with one process: torchrun --standalone --nproc-per-node 1 ...")
    counts, in_phase = count_weight_quantizations()
    params = SamplingParams(n=args.samples, max_new_tokens=args.new_tokens, seed=0, ignore_eos=True)
    paths = {}
    for name in ("single", "sharded"):
        model, tokenizer = build(args.model, torch.bfloat16)
        model.train()
        policy = Policy(model, tokenizer, args.strategy, device=world.device)
        sync = policy.sync_weights
        if name == "sharded":
            jd.shard_policy(policy, world)
            sync = lambda policy=policy: jd.sync_rollout_weights(policy, world)
        engine = RolloutEngine(policy, chat_template=False)
        engine.generate, sync = in_phase(engine.generate, "rollout"), in_phase(sync, "sync")
        optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-6)
        paths[name] = (policy, engine, optimizer, sync)
    prompts = torch.randint(10, model.config.vocab_size, (args.prompts, args.prompt_len),
                            generator=torch.Generator().manual_seed(1)).tolist()
    results, quantized, tables = {name: [] for name in paths}, {}, {}
    for i in range(args.pairs + 1):
        order = list(paths) if i % 2 == 0 else list(reversed(paths))
        for name in order:
            policy, engine, optimizer, sync = paths[name]
            counts.clear()
            step = lambda: grpo_step.grpo_step(policy, engine, optimizer, prompts, params, args.micro_batch,
                                               torch.Generator().manual_seed(2), sync)
            if args.profile and i == args.pairs:
                from torch.profiler import profile, ProfilerActivity
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if world.device.type == "cuda" else [])
                with profile(activities=activities) as prof: row = step()
                tables[name] = op_table(prof)
            else: row = step()
            if i: results[name].append(row); quantized[name] = dict(counts)
    report = {name: {k: round(statistics.median(r[k] for r in rows), 4) for k in PHASES} for name, rows in results.items()}
    ratio = {k: round(statistics.median(b[k] / a[k] for a, b in zip(results["single"], results["sharded"]) if a[k] > 0), 4)
             for k in PHASES}
    print(json.dumps({"model": args.model, "strategy": args.strategy, "micro_batch": args.micro_batch, "pairs": args.pairs,
                      "device": str(world.device), "median_s": report, "ratio_sharded_to_single": ratio,
                      "weight_quantizations_per_step": quantized, "command": "torchrun --standalone --nproc-per-node 1 "
                      "benchmarks/grpo_step_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)}), flush=True)
    if tables:
        print(f"ops that differ most, single -> sharded (last pair, whole step incl. profiler overhead):")
        print("\n".join(largest_differences(tables["single"], tables["sharded"], args.top)))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
