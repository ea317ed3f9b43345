"""Time a transformer MLP block, forward + backward, compiled: BF16 vs jetrl's FP8 linear per recipe, with
torchao's float8 training in the same run as the reference.

    python -m benchmarks linear                     # 7B-shaped: d=4096, hidden=11008, 16384 tokens
    python -m benchmarks linear --out benchmarks/results/linear_h200.json
    python -m benchmarks linear --tokens 2048 --no-torchao --reps 10      # a quicker, smaller run

One row per configuration (implementation, recipe, ms, speedup_vs_bf16, TFLOP/s, output SQNR), then a markdown table.
Needs a CUDA GPU with FP8 tensor cores (blockwise: Hopper); torchao is optional (its blockwise prototype compiles for
minutes).
"""
import argparse, copy, logging, statistics, sys, time, traceback
import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.common import add_output_args, emit, event_times_ms, make_row, need_cuda
from jetrl.linear import convert_to_fp8, get_recipe
from jetrl.options import use_kernel_options


class MLP(nn.Module):
    "The gated MLP of a Llama/Qwen block: down(silu(gate(x)) * up(x))."
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def print_top_kernels(step, title: str, steps: int = 3, top: int = 14):
    "Where one step's GPU time goes: the kernels with the most total time, per step."
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps): step()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / steps / 1e3
    print(f"# {title}: {total:.2f} ms of kernels per step", file=sys.stderr)
    for e in events[:top]:
        print(f"#   {e.device_time_total / steps / 1e3:7.3f} ms  x{e.count // steps:<3d} {e.key[:110]}", file=sys.stderr)


def torchao_variants():
    "torchao's float8 training recipes available here, as (name, convert function)."
    logging.getLogger("torchao").setLevel(logging.ERROR)
    variants = []
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        for recipe in ("tensorwise", "rowwise"):
            config = Float8LinearConfig.from_recipe_name(recipe)
            variants.append((recipe, lambda m, c=config: convert_to_float8_training(m, config=c)))
    except Exception as e:  # noqa: BLE001 - report and go on without the reference
        print(f"# torchao float8 unavailable: {e!r}", file=sys.stderr)
    try:
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear
        def to_blockwise(m):
            for name, child in list(m.named_children()):
                if isinstance(child, nn.Linear): setattr(m, name, Float8BlockwiseLinear.from_float(child))
            return m
        variants.append(("blockwise", to_blockwise))
    except Exception as e:  # noqa: BLE001
        print(f"# torchao blockwise prototype unavailable: {e!r}", file=sys.stderr)
    return variants


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks linear", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=11008)
    p.add_argument("--recipes", default="blockwise,rowwise,tensorwise")
    p.add_argument("--no-torchao", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--profile", action="store_true", help="print the top GPU kernels of each jetrl configuration")
    add_output_args(p)
    args = p.parse_args(argv)
    need_cuda("linear")
    with use_kernel_options(args.kernels): run_all(args, argv)


def run_all(args, argv):

    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    base = MLP(args.dim, args.hidden).to(device, dtype)
    x = torch.randn(args.tokens, args.dim, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(args.tokens, args.dim, device=device, dtype=dtype)
    gemm_flops = 3 * 3 * 2 * args.tokens * args.dim * args.hidden   # 3 linears x (fprop, dgrad, wgrad)

    configs = [("torch", "bf16", lambda m: m)]
    configs += [("jetrl", r, lambda m, r=r: convert_to_fp8(m, get_recipe(r))) for r in args.recipes.split(",")]
    if not args.no_torchao: configs += [("torchao", name, fn) for name, fn in torchao_variants()]

    torch._dynamo.config.cache_size_limit = 64   # one compiled graph per configuration, all of one MLP.forward
    results, bf16_ms = [], None
    with torch.no_grad(): y_ref = base(x).float()
    for impl, recipe, convert in configs:
        torch._dynamo.reset()
        model = convert(copy.deepcopy(base))
        run = model if args.no_compile else torch.compile(model)
        params = list(model.parameters())
        def step():
            y = run(x)
            return torch.autograd.grad(y, [x, *params], dy)
        t0 = time.perf_counter()
        try:
            grads = step(); torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a reference that fails here is reported, not fatal
            traceback.print_exc()                   # the whole story on stderr; the JSON line and the results file: its gist
            results.append(emit(make_row("linear", {"impl": impl, "recipe": recipe, "error": repr(e)[:2000]}, argv), args.out))
            continue
        compile_s = time.perf_counter() - t0
        y = run(x).detach().float()
        out_sqnr = float(20 * torch.log10(y_ref.norm() / (y_ref - y).norm())) if impl != "torch" else float("inf")
        del y, grads
        times = event_times_ms(step, iters=args.reps, warmup=args.warmup)
        ms = statistics.median(times)
        if impl == "torch": bf16_ms = ms
        row = dict(impl=impl, recipe=recipe, ms=round(ms, 3), ms_min=round(min(times), 3),
                   speedup_vs_bf16=round(bf16_ms / ms, 3), tflops=round(gemm_flops / ms / 1e9, 1),
                   output_sqnr_db=round(out_sqnr, 1), compile_s=round(compile_s, 1),
                   tokens=args.tokens, dim=args.dim, hidden=args.hidden, compiled=not args.no_compile)
        results.append(emit(make_row("linear", row, argv), args.out))
        if args.profile and impl != "torchao": print_top_kernels(step, f"{impl} {recipe}")
        del model, run
        torch.cuda.empty_cache()
    print("\n| impl | recipe | ms | speedup vs bf16 | TFLOP/s | output SQNR dB |\n|---|---|---|---|---|---|")
    for r in results:
        if "error" in r: continue
        print(f"| {r['impl']} | {r['recipe']} | {r['ms']} | {r['speedup_vs_bf16']}x | {r['tflops']} | {r['output_sqnr_db']} |")


if __name__ == "__main__":
    main()
