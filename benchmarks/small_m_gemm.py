"""Decode-sized GEMMs: BF16 vs blockwise FP8 through cuBLAS vs jetrl's Triton kernel, the weights of Qwen2-0.5B
and a 7B Qwen2 shape, a few rows (one per sequence of the decode batch). GEMM only: operands pre-quantized.

    python benchmarks/small_m_gemm.py --out benchmarks/results/small_m_gemm_h200.jsonl
Prints one JSON object per (model, projection, rows).
"""
import argparse, json, sys
import torch
import torch.nn.functional as F

import jetrl.fp8 as fp8
from jetrl.fp8 import kernel_weight_scale, quantize_unchecked

PROJECTIONS = {  # name: (K, N) = (in_features, out_features)
    "qwen2-0.5b": {"q/o": (896, 896), "k/v": (896, 128), "gate/up": (896, 4864), "down": (4864, 896), "lm_head-like": (896, 151936)},
    "qwen2-7b": {"q/o": (3584, 3584), "k/v": (3584, 512), "gate/up": (3584, 18944), "down": (18944, 3584)},
}


def time_us(fn, reps: int = 200) -> float:
    for _ in range(10): fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); start.record()
    for _ in range(reps): fn()
    end.record(); torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,16,64,128")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    for model, projections in PROJECTIONS.items():
        for name, (K, N) in projections.items():
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
            w_fp8 = quantize_unchecked(w, (128, 128))
            w_scale = kernel_weight_scale(w_fp8)
            for M in map(int, args.rows.split(",")):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                x_fp8 = quantize_unchecked(x, (1, 128))
                gemm = lambda: fp8.fp8_mm(x_fp8, w_fp8.t(), out_dtype=torch.bfloat16, b_kernel_scale=w_scale)
                fp8.SMALL_M_MAX = 0; cublas_us, cublas = time_us(gemm), gemm().float()
                fp8.SMALL_M_MAX = 1 << 30; triton_us, triton = time_us(gemm), gemm().float()
                bf16_us = time_us(lambda: F.linear(x, w))
                row = dict(model=model, projection=name, rows=M, K=K, N=N, bf16_us=round(bf16_us, 1),
                           fp8_cublas_us=round(cublas_us, 1), fp8_triton_us=round(triton_us, 1),
                           triton_vs_cublas_rel=float((triton - cublas).norm() / cublas.norm()),
                           weight_GBps_bf16=round(2 * N * K / bf16_us / 1e3, 0), weight_GBps_triton=round(N * K / triton_us / 1e3, 0),
                           gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           command="python benchmarks/small_m_gemm.py " + " ".join(sys.argv[1:] if argv is None else argv))
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as f: f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
