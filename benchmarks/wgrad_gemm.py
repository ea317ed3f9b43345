"""Wgrad's FP8 GEMM on a GPU, in both orientations, and how its result joins the weight's gradient.

    python benchmarks/wgrad_gemm.py --out benchmarks/results/wgrad_gemm_h200.jsonl

Why. In session 11's 7B profile (benchmarks/results/profile_train_7b_h200_session11.txt) cuBLAS's Wgrad GEMM (both operands
1x128-scaled along the tokens) ran ~1.5 ms where the Fprop GEMM of the same FLOPs ran ~1.1 ms, and every Wgrad result
was followed by a non-vectorized add (the weight's gradient accumulating over micro-batches). This measures, at the
7B (and 0.5B) linears' shapes and one micro-batch of tokens:
- `dW = dy^T x` (N_out, K_in): jetrl's orientation today;
- `dW^T = x^T dy` (K_in, N_out): the same products and block scales, cuBLAS given the operands the other way round;
  its result lands transposed, so it is timed alone and with the copy that makes it (N_out, K_in) again;
- the bf16 GEMM `dy^T x` for reference;
- accumulating dW into an existing gradient: `grad += dW` contiguous, and with dW transposed.
GPU time of each from CUDA graphs (`jetrl.kernels.graph_time_ms`). Both orientations must agree to fp32 rounding (the
sums' order inside cuBLAS is its own); the largest relative difference is printed.
"""
import argparse, json, sys
import torch

from jetrl.fp8 import KERNEL_BLOCK, _fp8_gemm
from jetrl.kernels import graph_time_ms

SHAPES = {"qwen2-7b": [(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944)],
          "qwen2-0.5b": [(896, 896), (128, 896), (4864, 896), (896, 4864)]}     # (N_out, K_in): q/o, k/v, gate/up, down


def fp8_operand(rows: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    "(rows, tokens) FP8 bytes and their (rows, tokens / 128) scales: a Wgrad operand, 1x128 along the tokens."
    data = (torch.randn(rows, tokens, device="cuda") * 8).to(torch.float8_e4m3fn)
    scale = torch.rand(rows, tokens // KERNEL_BLOCK, device="cuda") + 0.5
    return data, scale


def measure(model: str, n_out: int, k_in: int, tokens: int) -> dict:
    dy, dy_scale = fp8_operand(n_out, tokens)            # dy^T, K-major (tokens last)
    x, x_scale = fp8_operand(k_in, tokens)               # x^T, K-major
    layout = "blockwise_1x128_1x128"
    today = lambda: _fp8_gemm(dy, dy_scale, x, x_scale, layout, torch.bfloat16)           # (N_out, K_in)
    turned = lambda: _fp8_gemm(x, x_scale, dy, dy_scale, layout, torch.bfloat16)          # (K_in, N_out)
    a, b = today().float(), turned().float().t()
    rel = ((a - b).abs().max() / a.abs().max()).item()
    assert rel < 1e-2, f"the two orientations disagree beyond fp32 sums rounded to bf16: {rel:.2e}"   # measured <= 3.4e-3
    dy_bf16, x_bf16 = torch.randn(tokens, n_out, device="cuda", dtype=torch.bfloat16), torch.randn(tokens, k_in, device="cuda", dtype=torch.bfloat16)
    grad = torch.zeros(n_out, k_in, device="cuda", dtype=torch.bfloat16)
    dw, dw_t = today(), turned()
    def add_contiguous(): grad.add_(dw)
    def add_transposed(): grad.add_(dw_t.t())
    row = {"model": model, "n_out": n_out, "k_in": k_in, "tokens": tokens,
           "fp8_today_ms": graph_time_ms(today), "fp8_turned_ms": graph_time_ms(turned),
           "fp8_turned_then_copy_ms": graph_time_ms(lambda: turned().t().contiguous()),
           "bf16_ms": graph_time_ms(lambda: dy_bf16.t() @ x_bf16),
           "add_contiguous_ms": graph_time_ms(add_contiguous), "add_transposed_ms": graph_time_ms(add_transposed),
           "turned_vs_today_rel_diff": rel}
    row["tflops_today"] = 2 * n_out * k_in * tokens / row["fp8_today_ms"] / 1e9
    return row


def grad_layout_check() -> dict:
    "The strides and kernels of an FP8Linear's weight gradient after two backward passes (micro-batches accumulating)."
    from torch.profiler import profile, ProfilerActivity
    from jetrl.linear import FP8Linear
    layer = FP8Linear(3584, 18944, bias=False, recipe="blockwise", device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4096, 3584, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(4096, 18944, device="cuda", dtype=torch.bfloat16)       # a dense gradient, as a backward sees
    layer(x).backward(dy)
    first = (tuple(layer.weight.grad.stride()), layer.weight.grad.dtype, layer.weight.grad.data_ptr() % 16)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer(x).backward(dy); torch.cuda.synchronize()
    kernels = sorted({e.name[:100] for e in prof.events() if "add" in e.name.lower() or "elementwise" in e.name.lower()})
    return {"grad_stride_after_first": first[0], "grad_dtype": str(first[1]), "grad_ptr_mod16": first[2],
            "add_kernels_in_second_backward": kernels}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=10240, help="one micro-batch: 16 rows x 640 tokens")
    p.add_argument("--models", default="qwen2-7b,qwen2-0.5b")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.tokens % KERNEL_BLOCK: p.error(f"--tokens must be a multiple of {KERNEL_BLOCK} (whole token groups), got {args.tokens}")
    command = "python " + " ".join(sys.argv)
    rows = []
    print(json.dumps(grad_layout_check()), flush=True)
    for model in args.models.split(","):
        for n_out, k_in in SHAPES[model]:
            row = measure(model, n_out, k_in, args.tokens)
            row.update(command=command, gpu=torch.cuda.get_device_name(), torch=torch.__version__)
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                              if k not in ("command", "gpu", "torch")}), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for row in rows: f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
