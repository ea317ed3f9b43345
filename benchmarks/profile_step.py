"""Where a GRPO step's GPU time goes, per strategy: the kernels of eager decode steps and of one training micro-batch.

    python -m benchmarks profile --model qwen2-7b --rows 128 --strategies bf16,jet
    python -m benchmarks profile --model qwen2-0.5b --strategies bf16,jet --train-only --cuda-graphs
    python -m benchmarks profile --model qwen2-7b --strategies bf16,jet --train-only --shapes   # ops by input shapes

Eager (no CUDA graphs) so that every kernel is seen; kernel times are what a graph replays, minus launch gaps.
Prints, per strategy: the graphed decode step time (from the engine's own timing), then the top kernels by GPU
time for --decode-steps eager decode steps and for one forward + backward of --micro-batch rows. Prints tables, no rows
(profiler tables: save them with `> FILE`).
"""
import argparse, time
import torch
from torch.autograd import DeviceType
from torch.profiler import profile, ProfilerActivity

from benchmarks.common import build, need_cuda, parse_kernels
from jetrl.options import KernelOptions, use_kernel_options
from jetrl.policy import Policy, GraphedLogProbs, token_log_probs
from jetrl.rollout import RolloutEngine, SamplingParams


def top_kernels(prof, n: int) -> str:
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=n, max_name_column_width=70)


def kernel_totals(prof) -> dict:
    "kernel name -> (total GPU us, calls): the GPU kernels alone (not host ops, whose CUDA totals count their kernels again)"
    totals = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            t, c = totals.get(e.name, (0.0, 0))
            totals[e.name] = (t + e.time_range.elapsed_us(), c + 1)
    return totals


def kernel_table(prof, n: int) -> str:
    "The top n GPU kernels: total ms, share, calls, us per call."
    totals = kernel_totals(prof)
    whole = sum(t for t, _ in totals.values())
    lines = [f"  {'ms':>8} {'share':>6} {'calls':>6} {'us/call':>8}  kernel"]
    for name, (t, c) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:n]:
        lines.append(f"  {t / 1e3:8.2f} {t / whole:6.1%} {c:6d} {t / c:8.1f}  {name[:110]}")
    return "\n".join(lines)


def graphed_decode_kernels(engine, prompts, steps: int, n: int) -> str:
    """The kernels of one graphed decode step: a profile of `steps` + 1 new tokens minus one of 1 new token (the
    prefill and first sample), divided by `steps`. CUPTI records the kernels a CUDA graph replays."""
    totals = []
    for new in (1, steps + 1):
        params = SamplingParams(max_new_tokens=new, seed=0, ignore_eos=True)
        engine.generate(prompts, params)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, params); torch.cuda.synchronize()
        totals.append(kernel_totals(prof))
    short, long = totals
    per_step = {k: ((t - short.get(k, (0, 0))[0]) / steps, (c - short.get(k, (0, 0))[1]) / steps) for k, (t, c) in long.items()}
    # a kernel of the prefill whose time differs between the two runs (same calls) is noise, not part of a step
    per_step = {k: v for k, v in per_step.items() if v[0] > 0.5 and v[1] >= 0.5}
    total = sum(t for t, _ in per_step.values())
    lines = [f"kernel time per graphed decode step: {total / 1e3:.3f} ms over {sum(c for _, c in per_step.values()):.0f} kernels"]
    for k, (t, c) in sorted(per_step.items(), key=lambda kv: -kv[1][0])[:n]:
        lines.append(f"  {t:9.1f} us  {c:6.1f} calls  {t / max(c, 1e-9):7.2f} us/call  {k[:90]}")
    return "\n".join(lines)


def train_profile(policy, engine, prompts, strategy: str, args):
    """One training micro-batch (forward + backward), three ways: wall time per call (3 calls, synchronized), the sum
    of its kernels' GPU time, and the host ops that take the most CPU time. Wall far above kernel time means the GPU
    waits for Python (launches, small ops), and fusing kernels will not help until the host work shrinks."""
    rollout = engine.generate(prompts[: args.micro_batch], SamplingParams(max_new_tokens=512, seed=0, ignore_eos=True))
    ids, mask = rollout.input_ids, rollout.attention_mask
    # --cuda-graphs: the micro-batch replayed from CUDA graphs (GraphedLogProbs, as train(cuda_graphs=True) runs it);
    # CUPTI records the kernels a graph replays, so the kernel table is the same kind of table
    forward = GraphedLogProbs(policy.model) if args.cuda_graphs else (lambda i, m: token_log_probs(policy.model, i, m))
    step = lambda: forward(ids, mask).sum().backward()
    step(); torch.cuda.synchronize()                                          # warm-up (and the capture)
    walls = []
    for _ in range(3):
        start = time.perf_counter(); step(); torch.cuda.synchronize(); walls.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=args.shapes) as prof:
        step(); torch.cuda.synchronize()
    gpu_ms = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA) / 1e3
    events = prof.key_averages()
    print(f"\n##### {strategy}: one training micro-batch ({args.micro_batch} x {ids.shape[1]}), forward + backward"
          f"{' from CUDA graphs' if args.cuda_graphs else ''}: "
          f"wall {1e3 * sorted(walls)[1]:.1f} ms (median of 3), GPU kernels {gpu_ms:.1f} ms", flush=True)
    print(f"--- {strategy}: top kernels by GPU time")
    print(kernel_table(prof, args.top))
    print(f"--- {strategy}: top ops by GPU time (an op's total includes its kernels)")
    print(top_kernels(prof, args.top))
    print(f"--- {strategy}: top host ops by self CPU time")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=70), flush=True)
    if args.shapes:           # which tensors an op's kernels ran on: e.g. whose elementwise adds are not vectorized
        print(f"--- {strategy}: top ops by GPU time, per input shapes")
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=args.top,
                                                                  max_name_column_width=50, max_shapes_column_width=90), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks profile", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2-7b")
    p.add_argument("--strategies", default="bf16,jet")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--top", type=int, default=22)
    p.add_argument("--decode-only", action="store_true", help="only the graphed decode step's kernels")
    p.add_argument("--train-only", action="store_true",
                   help="only the training micro-batch: wall time against kernel time, and the host's busiest ops")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="the training micro-batch replayed from CUDA graphs (GraphedLogProbs), as train(cuda_graphs=True)")
    p.add_argument("--shapes", action="store_true",
                   help="--train-only: also the ops grouped by their input shapes (the profiler records them: slower)")
    p.add_argument("--kernels", type=parse_kernels, default=KernelOptions(), metavar="NAME=VALUE,...",
                   help="kernel options for the run (jetrl.options.KernelOptions fields)")
    args = p.parse_args(argv)
    need_cuda("profile")
    with use_kernel_options(args.kernels): run(args)


def run(args):
    for strategy in args.strategies.split(","):
        model, tokenizer = build(args.model, torch.bfloat16)
        policy = Policy(model, tokenizer, strategy, device="cuda")
        prompts = torch.randint(10, model.config.vocab_size, (args.rows, args.prompt_len),
                                generator=torch.Generator().manual_seed(1)).tolist()
        graphed = RolloutEngine(policy, chat_template=False)
        if args.train_only:
            train_profile(policy, graphed, prompts, strategy, args)
            del policy, graphed, model; torch.cuda.empty_cache(); continue
        params = SamplingParams(max_new_tokens=64, seed=0, ignore_eos=True)
        graphed.generate(prompts, params)
        timing = graphed.generate(prompts, params).timing
        print(f"\n##### {strategy}: graphed decode {1e3 * timing['decode_s'] / 64:.2f} ms/step, prefill {1e3 * timing['prefill_s']:.1f} ms")
        print(graphed_decode_kernels(graphed, prompts, 32, args.top), flush=True)
        if args.decode_only:
            del policy, graphed, model; torch.cuda.empty_cache(); continue
        eager = RolloutEngine(policy, chat_template=False, cuda_graphs=False)
        short = SamplingParams(max_new_tokens=args.decode_steps, seed=0, ignore_eos=True)
        eager.generate(prompts, short)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eager.generate(prompts, short)
            torch.cuda.synchronize()
        print(f"--- {strategy}: prefill + {args.decode_steps} eager decode steps, top kernels")
        print(top_kernels(prof, args.top))
        rollout = graphed.generate(prompts[: args.micro_batch], SamplingParams(max_new_tokens=512, seed=0, ignore_eos=True))
        ids, mask = rollout.input_ids, rollout.attention_mask
        token_log_probs(policy.model, ids, mask).sum().backward()                     # warm-up
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            token_log_probs(policy.model, ids, mask).sum().backward()
            torch.cuda.synchronize()
        print(f"--- {strategy}: one training micro-batch ({args.micro_batch} x {ids.shape[1]}), forward + backward, top kernels")
        print(top_kernels(prof, args.top))
        del policy, graphed, eager, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
