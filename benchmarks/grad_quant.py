"""Time the FP8 linear's backward quantization on a GPU: the old passes against jetrl.grad_kernels' fused ones.

    python -m benchmarks grad_quant                      # Qwen2-7B linears, 16 x 640 = 10240 tokens
    python -m benchmarks grad_quant --sweep --out benchmarks/results/grad_quant_h200.jsonl

Per linear shape (M tokens, K inputs, N outputs), blockwise recipe, bf16 activations and gradients:
- old: (a) the saved FP8 x dequantized to bf16 (eager), (b) that copy quantized along the tokens (x.T, 1x128),
  (c) dy in 1x128 groups, (d) dy.T in 1x128 groups; new: `requantize_for_wgrad` (replaces a + b) and
  `quantize_dual_1x128` (replaces c + d). Each pass: median ms (CUDA events) and the bandwidth of the bytes it must
  move at least (inputs read once, outputs written once);
- the bytes and scales of old and new, compared (torch.equal on the codes);
- one FP8LinearFunction forward + backward, old passes vs fused, its dx and dW compared bit for bit.
Each pass is timed twice: `_ms` around one eager call (CUDA events; at small shapes this is the CPU's launch
overhead: Python, the custom op, the FP8Tensor), and `_graph_ms` as the GPU's time alone (20 calls captured in one CUDA
graph, replayed; repeated calls read the same input, so one that fits the H200's 50 MB L2, as dy at N=512 does,
can show more than HBM's bandwidth). --sweep also times the dual quantizer at every launch of
`jetrl.grad_kernels.LAUNCH_CANDIDATES` (form: tile or quads, warps, register cap) and the requantizer
at every launch of `REQUANTIZE_CANDIDATES` (the forms with tiles of fewer columns), checks each one's bytes against the
old passes, to choose DUAL_LAUNCH / REQUANTIZE_LAUNCH; it prints two compact tables per shape.
"""
import argparse, sys
import torch

from benchmarks.common import add_output_args, emit, event_time_ms, make_row, need_cuda

from jetrl import grad_kernels
from jetrl.grad_kernels import quantize_dual_1x128, requantize_for_wgrad, fused_grad_quantizers
from jetrl.kernels import quantize_1x128
from jetrl.linear import FP8LinearFunction, get_recipe

QWEN2_7B = "3584x18944,18944x3584,3584x3584,3584x512"      # K x N: gate/up, down, q/o, k/v


def median_ms(fn, warmup: int = 3, reps: int = 20) -> float:
    "Median time of fn() in ms by CUDA events, after `warmup` calls (Triton compiles on the first)."
    return event_time_ms(fn, iters=reps, warmup=warmup)


def graph_ms(fn, calls: int = 20, reps: int = 10) -> float:
    "The GPU's time of one fn() in ms, without the CPU's launch overhead: `calls` calls in one CUDA graph, median replay."
    fn(); torch.cuda.synchronize()                              # compiled (and the memory pool warm) before capture
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls): fn()
    except RuntimeError as e:                                   # a pass that cannot be captured: no GPU-only time
        print(f"  (not capturable in a CUDA graph: {str(e).splitlines()[0]})")
        return float("nan")
    return median_ms(graph.replay, warmup=2, reps=reps) / calls


def same_bytes(a, b) -> bool:
    return (a.data.shape == b.data.shape and a.data.stride() == b.data.stride() and a.block == b.block
            and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale))


def passes(M: int, K: int, N: int) -> dict:
    "Old and new passes at one shape: ms, GB/s of the least bytes each must move, and whether the bytes agree."
    torch.manual_seed(0)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    x_fp8 = quantize_1x128(torch.randn(M, K, device="cuda", dtype=torch.bfloat16))
    x_bf16 = x_fp8.dequantize(torch.bfloat16)
    scale_bytes = lambda rows, cols: 4 * rows * -(-cols // 128)
    timed = {   # name: (function, least bytes moved)
        "old_a_dequantize_x": (lambda: x_fp8.dequantize(torch.bfloat16), M * K * 3 + scale_bytes(M, K)),
        "old_b_quantize_xT": (lambda: quantize_1x128(x_bf16.t()), M * K * 3 + scale_bytes(K, M)),
        "old_c_quantize_dy": (lambda: quantize_1x128(dy), M * N * 3 + scale_bytes(M, N)),
        "old_d_quantize_dyT": (lambda: quantize_1x128(dy.t()), M * N * 3 + scale_bytes(N, M)),
        "new_requantize_x": (lambda: requantize_for_wgrad(x_fp8, torch.bfloat16), M * K * 2 + scale_bytes(M, K) + scale_bytes(K, M)),
        "new_dual_dy": (lambda: quantize_dual_1x128(dy), M * N * 4 + scale_bytes(M, N) + scale_bytes(N, M)),
    }
    row = {}
    for name, (fn, nbytes) in timed.items():
        row[name + "_ms"] = ms = median_ms(fn)
        row[name + "_gbps"] = nbytes / ms / 1e6
        row[name + "_graph_ms"] = ms = graph_ms(fn)
        row[name + "_graph_gbps"] = nbytes / ms / 1e6
    row["old_total_ms"] = sum(v for k, v in row.items() if k.startswith("old_") and k.endswith("_ms") and "graph" not in k)
    row["new_total_ms"] = row["new_requantize_x_ms"] + row["new_dual_dy_ms"]
    dgrad, wgrad = quantize_dual_1x128(dy)
    row["bytes_equal"] = (same_bytes(dgrad, quantize_1x128(dy)) and same_bytes(wgrad, quantize_1x128(dy.t()).t())
                          and same_bytes(requantize_for_wgrad(x_fp8, torch.bfloat16), quantize_1x128(x_bf16.t()).t()))
    return row


def layer_step(M: int, K: int, N: int) -> dict:
    "One FP8LinearFunction forward + backward (bf16), old passes vs fused: ms, and dx / dW compared bit for bit."
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") / K**0.5).to(torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    recipe, row, grads = get_recipe("blockwise"), {}, {}
    for fused in (False, True):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        def step():
            xi.grad = wi.grad = None
            FP8LinearFunction.apply(xi, wi, None, recipe).backward(dy)
        with fused_grad_quantizers(fused):
            row[f"layer_{'new' if fused else 'old'}_ms"] = median_ms(step, reps=10)
            step()
        grads[fused] = (xi.grad, wi.grad)
    row["grads_equal"] = torch.equal(grads[False][0], grads[True][0]) and torch.equal(grads[False][1], grads[True][1])
    return row


def launch_name(launch: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in launch.items())


def sweep(M: int, K: int, N: int) -> list[dict]:
    """The dual quantizer at every launch of LAUNCH_CANDIDATES, the requantizer at every one of REQUANTIZE_CANDIDATES:
    one row per (kernel, launch) with eager and graph ms, GB/s of the graph time, and whether the bytes equal the old
    passes'. The tables are restored afterwards."""
    torch.manual_seed(0)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    x_fp8 = quantize_1x128(torch.randn(M, K, device="cuda", dtype=torch.bfloat16))
    want_dgrad, want_wgrad = quantize_1x128(dy), quantize_1x128(dy.t()).t()
    want_x = quantize_1x128(x_fp8.dequantize(torch.bfloat16).t()).t()
    dual, requantize = lambda: quantize_dual_1x128(dy), lambda: requantize_for_wgrad(x_fp8, torch.bfloat16)
    kernels = {   # kernel: (its launch table, the launches to time, the call, its bytes checked, least bytes moved)
        "dual": (grad_kernels.DUAL_LAUNCH, grad_kernels.LAUNCH_CANDIDATES, dual,
                 lambda: all(map(same_bytes, dual(), (want_dgrad, want_wgrad))),
                 M * N * 4 + 4 * M * -(-N // 128) + 4 * N * -(-M // 128)),
        "requantize": (grad_kernels.REQUANTIZE_LAUNCH, grad_kernels.REQUANTIZE_CANDIDATES, requantize,
                       lambda: same_bytes(requantize(), want_x), M * K * 2 + 4 * M * -(-K // 128) + 4 * K * -(-M // 128)),
    }
    rows = []
    for kernel, (table, candidates, fn, check, nbytes) in kernels.items():
        default = dict(table)
        try:
            for launch in candidates:
                table.clear(); table.update(launch)
                row = dict(kernel=kernel, launch=launch_name(launch), default=launch == default)
                try:
                    row.update(bytes_equal=check(), ms=median_ms(fn), graph_ms=graph_ms(fn))
                except Exception as e:          # e.g. a launch that does not compile: reported, the sweep goes on
                    row.update(bytes_equal=None, ms=float("nan"), graph_ms=float("nan"),
                               error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                row["graph_gbps"] = nbytes / row["graph_ms"] / 1e6
                rows.append(row)
        finally:
            table.clear(); table.update(default)
    return rows


def print_sweep(rows: list[dict]):
    for kernel, candidates in (("dual", "LAUNCH_CANDIDATES"), ("requantize", "REQUANTIZE_CANDIDATES")):
        print(f"  {kernel + ' (' + candidates + ')':40} {'ms':>8} {'graph ms':>9} {'GB/s':>6}  bytes")
        for r in (r for r in rows if r["kernel"] == kernel):
            verdict = "FAILED " + r["error"] if "error" in r else "equal" if r["bytes_equal"] else "DIFFER"
            print(f"{'*' if r['default'] else ' '} {r['launch']:40} {r['ms']:8.3f} {r['graph_ms']:9.3f} "
                  f"{r['graph_gbps']:6.0f}  {verdict}")
    print("  (*: today's DUAL_LAUNCH / REQUANTIZE_LAUNCH; GB/s of the graph time)")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks grad_quant", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=10240, help="M: rows of a micro-batch (16 x 640 by default)")
    p.add_argument("--shapes", default=QWEN2_7B, help="comma-separated KxN of the linears")
    p.add_argument("--sweep", action="store_true",
                   help="also time the dual quantizer at every launch of LAUNCH_CANDIDATES, the requantizer at every one of "
                        "REQUANTIZE_CANDIDATES (bytes checked)")
    add_output_args(p, kernels=False)
    args = p.parse_args(argv)
    if args.sweep and args.tokens % 4:
        p.error(f"--sweep times the quads launches, which need tokens in multiples of 4 (else the tile form runs in "
                f"their place): --tokens {args.tokens} is not")
    need_cuda("grad_quant")
    M, ok = args.tokens, True
    for shape in args.shapes.split(","):
        K, N = map(int, shape.split("x"))
        row = dict(M=M, K=K, N=N, **passes(M, K, N), **layer_step(M, K, N))
        print(f"\nM={M} K={K} N={N}")
        for name in ("old_a_dequantize_x", "old_b_quantize_xT", "old_c_quantize_dy", "old_d_quantize_dyT",
                     "new_requantize_x", "new_dual_dy"):
            print(f"  {name:20} {row[name + '_ms']:8.3f} ms  {row[name + '_gbps']:7.0f} GB/s   graph "
                  f"{row[name + '_graph_ms']:8.3f} ms  {row[name + '_graph_gbps']:7.0f} GB/s")
        print(f"  passes: old {row['old_total_ms']:.3f} ms, new {row['new_total_ms']:.3f} ms "
              f"({row['old_total_ms'] / row['new_total_ms']:.2f}x); bytes equal: {row['bytes_equal']}")
        print(f"  FP8LinearFunction fwd+bwd: old {row['layer_old_ms']:.3f} ms, new {row['layer_new_ms']:.3f} ms; "
              f"dx, dW bit for bit: {row['grads_equal']}")
        if args.sweep:
            row["sweep"] = sweep(M, K, N)
            print_sweep(row["sweep"])
        ok &= row["bytes_equal"] and row["grads_equal"] and all(r["bytes_equal"] is not False for r in row.get("sweep", []))
        emit(make_row("grad_quant", row, argv), args.out, echo=False)
    if not ok: sys.exit("MISMATCH: the fused passes gave other bytes or gradients than the old ones")


if __name__ == "__main__":
    main()
