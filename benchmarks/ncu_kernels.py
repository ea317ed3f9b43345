"""jetrl's FP8 kernels under Nsight Compute's hardware counters: what bounds each one (one H200).

    ncu --clock-control none --profile-from-start off --set full --page details \
        python benchmarks/ncu_kernels.py > benchmarks/results/ncu_kernels_h200.txt

Every kernel runs a few times first (Triton compiles, caches warm), then once between `cudaProfilerStart` and
`cudaProfilerStop`, so with `--profile-from-start off` ncu reads exactly one launch of each. The kernels, at the
shapes of a 16 x 640-token micro-batch (10,240 tokens) and of the 7B rollout's decode (128 rows):
- the backward's quantizers: Wgrad's requantizer (`requantize_for_wgrad`, the saved FP8 x regrouped along the tokens)
  and the dual dy quantizer (`quantize_dual_1x128`), beside the forward's `quantize_1x128` (which streams at ~3.5 TB/s,
  session 14) as the reference of what a quantizer pass can reach;
- the decode GEMMs of one 7B layer (fused q/k/v, o, fused gate+up by the Triton kernel; down by the overlapped Gluon
  kernel where the GPU has it).
Without ncu it just runs them (a check that every kernel launches). --kernels picks a subset by name. On a machine
without a GPU, under Triton's interpreter (`TRITON_INTERPRET=1`), it checks that the calls run: there take a small
`--tokens` and a few `--kernels` (e.g. `--tokens 256 --kernels 0.5b`; the 7B decode GEMMs are slow to interpret).
"""
import argparse

import torch

TOKENS = 10240                                   # one training micro-batch: 16 rows x 640 tokens
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRAIN_SHAPES = {"qwen2-7b": (3584, 18944), "qwen2-0.5b": (896, 4864)}       # hidden, intermediate
DECODE_7B = (128, {"qkv": (4608, 3584), "o": (3584, 3584), "gate+up": (37888, 3584), "down": (3584, 18944)})


def quantizer_calls(tokens: int) -> dict:
    "name -> a call of one backward or forward quantizer pass at a micro-batch's shapes."
    from jetrl.grad_kernels import quantize_dual_1x128, requantize_for_wgrad
    from jetrl.kernels import quantize_1x128
    calls = {}
    for model, (hidden, inter) in TRAIN_SHAPES.items():
        torch.manual_seed(0)
        for K in (hidden, inter):
            x = torch.randn(tokens, K, device=DEVICE, dtype=torch.bfloat16)
            x_fp8 = quantize_1x128(x)
            calls[f"requantize {model} {tokens}x{K}"] = lambda x_fp8=x_fp8: requantize_for_wgrad(x_fp8, torch.bfloat16)
            calls[f"quantize_dual {model} {tokens}x{K}"] = lambda x=x: quantize_dual_1x128(x)
            calls[f"quantize_1x128 {model} {tokens}x{K}"] = lambda x=x: quantize_1x128(x)
    return calls


def decode_gemm_calls() -> dict:
    "name -> a call of one 7B decode GEMM (128 rows), by the kernel the rollout takes for it."
    from jetrl.fp8 import quantize, kernel_weight_scale
    from jetrl.kernels import quantize_1x128, launch_fp8_gemm, fp8_gemm_tiles, GLUON_DECODE_MIN_K_PER_N
    from jetrl.gluon_kernels import gluon_decode_possible, launch_decode_overlapped
    M, linears = DECODE_7B
    calls = {}
    for name, (N, K) in linears.items():
        torch.manual_seed(0)
        x = quantize_1x128(torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16))
        w = quantize(torch.randn(N, K, device=DEVICE) / K ** 0.5, (128, 128))
        w_scale, out = kernel_weight_scale(w), torch.empty(M, N, device=DEVICE, dtype=torch.bfloat16)
        if K >= GLUON_DECODE_MIN_K_PER_N * N and gluon_decode_possible(x.data, w.data, out):
            calls[f"decode 7b {name} gluon {M}x{N}x{K}"] = (
                lambda x=x, w=w, s=w_scale, o=out: launch_decode_overlapped(x.data, x.scale, w.data, s, None, o))
        else:
            tiles = fp8_gemm_tiles(M, N, K)
            calls[f"decode 7b {name} triton {tiles} {M}x{N}x{K}"] = (
                lambda x=x, w=w, s=w_scale, o=out, t=tiles: launch_fp8_gemm(x.data, x.scale, w.data, s, None, o, t))
    return calls


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", default="", help="comma-separated substrings of the call names to keep (default: all)")
    p.add_argument("--tokens", type=int, default=TOKENS, help="the micro-batch's tokens for the quantizers")
    args = p.parse_args(argv)
    calls = quantizer_calls(args.tokens) | decode_gemm_calls()
    wanted = [w for w in args.kernels.split(",") if w]
    calls = {k: v for k, v in calls.items() if not wanted or any(w in k for w in wanted)}
    for fn in calls.values():                    # compile and warm up, outside the profiled range
        for _ in range(3): fn()
    if DEVICE == "cpu": print(f"{len(calls)} calls ran under the interpreter: {', '.join(calls)}"); return
    torch.cuda.synchronize()
    cudart = torch.cuda.cudart()
    for name, fn in calls.items():               # ncu prints its reports after the run, in this order
        print(f"profiled: {name}", flush=True)
        cudart.cudaProfilerStart(); fn(); torch.cuda.synchronize(); cudart.cudaProfilerStop()


if __name__ == "__main__":
    main()
