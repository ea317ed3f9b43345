"""Does cuBLAS's blockwise FP8 GEMM give jetrl's batch-invariant kernel's bits? A probe, one H200 call (~1 minute).

    python benchmarks/cublas_bits.py --out benchmarks/results/cublas_bits_h200.jsonl

Why. The trainer's Fprop must give every row the bits the rollout's decode GEMM gives it, so jetrl runs its own
Triton kernel (K blocks of 128 in order, each block's FP8 product rescaled by its two scales before it joins the fp32
accumulator), at ~0.7x cuBLAS FP8 blockwise's speed. cuBLAS promises no order. But if its blockwise kernel computes
the same products in the same order, at every row count the trainer uses, the trainer could call it and keep the bits.
This probe answers that, per shape and row count, in fp32 output (the sharpest comparison), against:
- jetrl's kernel as it is (`acc += dot * (a_scale * w_scale)`, which the compiler may contract into one FMA);
- the same rescale in the three other roundings a kernel could use: not contracted (`enable_fp_fusion=False`), and
  the scales applied one after the other (`(dot * a_scale) * w_scale`, contracted and not).
It also checks cuBLAS against itself: the first 64 rows alone and inside every larger row count (row invariance).
"""
import argparse, json, math
import torch
import triton
import triton.language as tl

from jetrl.fp8 import quantize, fp8_mm, kernel_weight_scale, KERNEL_BLOCK
from jetrl.kernels import quantize_1x128, fp8_gemm_invariant

G = KERNEL_BLOCK


@triton.jit
def rescale_variant_gemm(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, M, N, K, stride_a, stride_a_scale, stride_w,
                         stride_w_scale, stride_out, ONE_BY_ONE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, G: tl.constexpr):
    # jetrl's order (K blocks in order, each product from zero), with the rescale written two ways
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, G)):
        k = kb * G + tl.arange(0, G)
        a = tl.load(a_ptr + rows[:, None] * stride_a + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_w + k[None, :], mask=col_ok[:, None] & (k < K)[None, :], other=0.0)
        a_scale = tl.load(a_scale_ptr + rows * stride_a_scale + kb, mask=row_ok, other=0.0)
        w_scale = tl.load(w_scale_ptr + (cols // G) * stride_w_scale + kb, mask=col_ok, other=0.0)
        p = tl.dot(a, tl.trans(w))
        if ONE_BY_ONE:
            acc += (p * a_scale[:, None]) * w_scale[None, :]
        else:
            acc += p * (a_scale[:, None] * w_scale[None, :])
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def variant(x_fp8, w_data, w_scale, one_by_one: bool, fused: bool):
    (M, K), N = x_fp8.data.shape, w_data.shape[0]
    out = torch.empty(M, N, device=w_data.device, dtype=torch.float32)
    a_scale = x_fp8.scale.contiguous()      # this variant reads the scales row-major (jetrl's quantizers: column-major)
    rescale_variant_gemm[(math.ceil(M / 64), math.ceil(N / 64))](
        x_fp8.data, a_scale, w_data, w_scale, out, M, N, K, x_fp8.data.stride(0), a_scale.stride(0),
        w_data.stride(0), w_scale.stride(0), out.stride(0), ONE_BY_ONE=one_by_one, BLOCK_M=64, BLOCK_N=64, G=G,
        num_warps=4, enable_fp_fusion=fused)
    return out


def compare(ref: torch.Tensor, other: torch.Tensor) -> dict:
    same = (ref.view(torch.int32) == other.view(torch.int32))
    diff = (ref - other).abs()
    return {"equal_frac": round(same.float().mean().item(), 6),
            "max_rel": float((diff / ref.abs().clamp_min(1e-30)).max().item())}


SHAPES = {"7b q/o": (3584, 3584), "7b k/v": (512, 3584), "7b gate/up": (18944, 3584), "7b down": (3584, 18944),
          "0.5b q/o": (896, 896), "0.5b gate/up": (4864, 896), "0.5b down": (896, 4864)}
ROWS = (1, 16, 64, 128, 256, 640, 2048, 10240)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cpu: check the script under TRITON_INTERPRET=1 (emulation for cuBLAS)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows_out, dev = [], args.device
    backend = "kernel" if dev == "cuda" else "emulated"
    shapes = SHAPES if dev == "cuda" else {"small": (256, 384)}
    row_counts = ROWS if dev == "cuda" else (1, 64, 130)
    for name, (N, K) in shapes.items():
        w = quantize(torch.randn(N, K, device=dev) * 0.02, (G, G))
        w_kernel_scale = kernel_weight_scale(w)
        x = torch.randn(max(row_counts), K, device=dev, dtype=torch.bfloat16)
        first64_cublas = fp8_mm(quantize_1x128(x[:64]), w.t(), torch.float32, backend=backend, b_kernel_scale=w_kernel_scale)
        for M in row_counts:
            x_fp8 = quantize_1x128(x[:M])
            cublas = fp8_mm(x_fp8, w.t(), torch.float32, backend=backend, b_kernel_scale=w_kernel_scale)
            jetrl = fp8_gemm_invariant(x_fp8, w, torch.float32, w_scale=w_kernel_scale)
            row = {"shape": name, "N": N, "K": K, "M": M, "cublas_vs_jetrl": compare(jetrl, cublas)}
            row["variant_is_jetrl"] = bool(torch.equal(variant(x_fp8, w.data, w_kernel_scale, False, True), jetrl))
            for one_by_one in (False, True):
                for fused in (True, False):
                    key = f"cublas_vs_{'(p*sa)*sb' if one_by_one else 'p*(sa*sb)'}_{'fma' if fused else 'nofma'}"
                    row[key] = compare(variant(x_fp8, w.data, w_kernel_scale, one_by_one, fused), cublas)["equal_frac"]
            k = min(M, 64)
            row["cublas_rows_invariant"] = bool(torch.equal(cublas[:k], first64_cublas[:k]))
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    if args.out:
        with open(args.out, "w") as f:
            for row in rows_out:
                f.write(json.dumps({**row, "command": "python benchmarks/cublas_bits.py", "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                                    "torch": torch.__version__}) + "\n")


if __name__ == "__main__":
    main()
