"""The trainer's FP8 GEMM, scheduled four ways, every one in today's exact reduction order (so bitwise today's kernel).

    python benchmarks/fp8_gemm_trainer.py --out benchmarks/results/fp8_gemm_trainer_h200.jsonl

Why. jetrl's FP8 GEMM sums the 128-deep K blocks in order, each block's FP8 product rescaled by its two scales before
it joins the fp32 accumulator (DeepSeek-V3's promotion). On an H200 it runs at ~600 TFLOP/s in the trainer, against
cuBLAS FP8 blockwise's 1,100-1,270 (`fp8_gemm_tiles_h200.jsonl`). A likely cause: each block's product starts from
zero and is needed at once, so the tensor cores wait for the rescale of one block before the next block's MMA.
The candidates change only the schedule, never an operation or its order, so no bit can move:
- `pairs`: two blocks per loop step, both products issued before either is added (`acc += p0; acc += p1`, the same
  two additions as before), so the second MMA may run while the first is rescaled;
- `tma`: the FP8 tiles loaded through Hopper's tensor-memory accelerator (host tensor descriptors; out-of-range
  elements read as zero, as the masked loads do);
- `tma+pairs`: both;
- `ws`: today's loop with Triton's automatic warp specialization (a producer warp group loading, consumers computing),
  where this Triton supports it on Hopper (Triton 3.6: it does not compile this loop);
- `tma+wscalar`: TMA loads, and the weight block's scale read once per tile (a tile of <= 128 columns lies in one
  128-wide weight block): BLOCK_M scale products per block instead of BLOCK_M x BLOCK_N, each the same fp32 product.
  Same bits only if the compiler contracts the rescale and the add the same way: the check says.
`--next` times only the TMA forms at tiles around session 5's winner (128 x 64, one warp group). Its session-6 run
(`benchmarks/results/fp8_gemm_trainer_h200.jsonl`, the rows with `--next`) made `tma+wscalar` in 64 x 128 tiles jetrl's
trainer GEMM (`ONE_WEIGHT_BLOCK` in jetrl.kernels): 1.14-1.26x the 128 x 64 TMA kernel at 7B, bit for bit the same.
Each is checked bit for bit against `jetrl.kernels.fp8_gemm_invariant` at every shape before it is timed (CUDA graphs).
"""
import argparse, json, math, sys
import torch
import triton
import triton.language as tl

from jetrl.fp8 import quantize, KERNEL_BLOCK
from jetrl.kernels import quantize_1x128, fp8_gemm_invariant, fp8_gemm_tiles
from jetrl.fp8 import fp8_mm, kernel_weight_scale

G = KERNEL_BLOCK


@triton.jit
def tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # jetrl's grouped tile order
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % (GROUP_M * tiles_n)) % group_rows, (pid % (GROUP_M * tiles_n)) // group_rows


@triton.jit
def load_block(a_src, w_src, rows, cols, row_ok, col_ok, tile_m, tile_n, kb, K, stride_a, stride_w, TMA: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr):
    # the FP8 tiles of K block kb: through tensor descriptors (TMA; zeros past the edges) or by masked pointer loads
    if TMA:
        a = a_src.load([tile_m * BLOCK_M, kb * G])
        w = w_src.load([tile_n * BLOCK_N, kb * G])
    else:
        k = kb * G + tl.arange(0, G)
        a = tl.load(a_src + rows[:, None] * stride_a + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        w = tl.load(w_src + cols[:, None] * stride_w + k[None, :], mask=col_ok[:, None] & (k < K)[None, :], other=0.0)
    return a, w


@triton.jit
def rescaled_product(a, w, a_scale_ptr, w_scale_ptr, rows, cols, row_ok, col_ok, tile_n, kb, stride_a_scale,
                     stride_w_scale, WSCALAR: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr):
    # one block's FP8 product from zero, rescaled exactly as jetrl's kernel does: dot * (a_scale * w_scale).
    # WSCALAR: the weight block's scale loaded once per tile (a tile of BLOCK_N <= 128 columns, dividing 128, lies in
    # one 128-wide weight block): BLOCK_M scale products instead of BLOCK_M x BLOCK_N, each the same fp32 product
    a_scale = tl.load(a_scale_ptr + rows * stride_a_scale + kb, mask=row_ok, other=0.0)
    if WSCALAR:
        w_scale = tl.load(w_scale_ptr + ((tile_n * BLOCK_N) // G) * stride_w_scale + kb)
        product = tl.dot(a, tl.trans(w)) * (a_scale * w_scale)[:, None]
    else:
        w_scale = tl.load(w_scale_ptr + (cols // G) * stride_w_scale + kb, mask=col_ok, other=0.0)
        product = tl.dot(a, tl.trans(w)) * (a_scale[:, None] * w_scale[None, :])
    return product


@triton.jit
def candidate_gemm(a_src, a_scale_ptr, w_src, w_scale_ptr, out_ptr, M, N, K, stride_a, stride_a_scale, stride_w,
                   stride_w_scale, stride_out, TMA: tl.constexpr, PAIRS: tl.constexpr, WS: tl.constexpr,
                   WSCALAR: tl.constexpr, STAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   G: tl.constexpr, GROUP_M: tl.constexpr):
    # every schedule of the benchmark: the K blocks in order into one fp32 accumulator, as jetrl's kernel sums them
    tile_m, tile_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    blocks = tl.cdiv(K, G)
    start = 0
    if PAIRS:                        # two products issued before either is added; the same two additions as before
        for pair in tl.range(0, blocks // 2, num_stages=STAGES):
            kb = 2 * pair
            a0, w0 = load_block(a_src, w_src, rows, cols, row_ok, col_ok, tile_m, tile_n, kb, K, stride_a, stride_w,
                                TMA, BLOCK_M, BLOCK_N, G)
            a1, w1 = load_block(a_src, w_src, rows, cols, row_ok, col_ok, tile_m, tile_n, kb + 1, K, stride_a, stride_w,
                                TMA, BLOCK_M, BLOCK_N, G)
            p0 = rescaled_product(a0, w0, a_scale_ptr, w_scale_ptr, rows, cols, row_ok, col_ok, tile_n, kb,
                                  stride_a_scale, stride_w_scale, WSCALAR, BLOCK_N, G)
            p1 = rescaled_product(a1, w1, a_scale_ptr, w_scale_ptr, rows, cols, row_ok, col_ok, tile_n, kb + 1,
                                  stride_a_scale, stride_w_scale, WSCALAR, BLOCK_N, G)
            acc += p0
            acc += p1
        start = 2 * (blocks // 2)
    for kb in tl.range(start, blocks, num_stages=STAGES, warp_specialize=WS):
        a, w = load_block(a_src, w_src, rows, cols, row_ok, col_ok, tile_m, tile_n, kb, K, stride_a, stride_w, TMA,
                          BLOCK_M, BLOCK_N, G)
        acc += rescaled_product(a, w, a_scale_ptr, w_scale_ptr, rows, cols, row_ok, col_ok, tile_n, kb, stride_a_scale,
                                stride_w_scale, WSCALAR, BLOCK_N, G)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def run_variant(variant: str, x_fp8, w_data, w_scale, out, tiles):
    (M, K), N = x_fp8.data.shape, w_data.shape[0]
    block_m, block_n, warps, stages, group_m = tiles
    tma = variant.startswith("tma")
    a_src, w_src = x_fp8.data, w_data
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        a_src, w_src = TensorDescriptor.from_tensor(a_src, [block_m, G]), TensorDescriptor.from_tensor(w_src, [block_n, G])
    a_scale = x_fp8.scale.contiguous()      # the candidates read the scales row-major (jetrl's quantizers: column-major)
    candidate_gemm[(math.ceil(M / block_m) * math.ceil(N / block_n),)](
        a_src, a_scale, w_src, w_scale, out, M, N, K, x_fp8.data.stride(0), a_scale.stride(0), w_data.stride(0),
        w_scale.stride(0), out.stride(0), TMA=tma, PAIRS="pairs" in variant, WS=variant == "ws",
        WSCALAR="wscalar" in variant, STAGES=stages, BLOCK_M=block_m, BLOCK_N=block_n, G=G, GROUP_M=group_m,
        num_warps=warps)
    return out


VARIANTS = ("loop", "pairs", "tma", "tma+pairs", "ws", "tma+wscalar")
TILES = ((128, 128, 8, 3, 8), (128, 64, 4, 4, 8), (128, 128, 8, 4, 8), (128, 256, 8, 3, 8))
# --next (session 5's follow-up): only the TMA forms, around the winning 128 x 64 tile
NEXT_VARIANTS = ("tma", "tma+wscalar")
NEXT_TILES = ((128, 64, 4, 4, 8), (128, 64, 4, 3, 8), (128, 64, 4, 5, 8), (64, 128, 4, 4, 8), (256, 64, 8, 4, 8),
              (128, 64, 8, 4, 8), (128, 32, 4, 4, 8), (128, 64, 4, 4, 16))
SHAPES = {"qwen2-7b": {"q/o": (3584, 3584), "gate/up": (18944, 3584), "down": (3584, 18944)},
          "qwen2-0.5b": {"q/o": (896, 896), "gate/up": (4864, 896), "down": (896, 4864)}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen2-7b,qwen2-0.5b")
    p.add_argument("--rows", type=int, default=10240, help="trainer micro-batch tokens")
    p.add_argument("--out", default=None)
    p.add_argument("--next", action="store_true", help="only the TMA forms, at the tiles around session 5's winner")
    args = p.parse_args(argv)
    variants, tiles_list = (NEXT_VARIANTS, NEXT_TILES) if args.next else (VARIANTS, TILES)
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    if on_gpu: from fp8_gemm_tiles import graph_time_us
    else: graph_time_us = lambda fn: float("nan")                     # TRITON_INTERPRET=1 on a CPU: values only
    meta = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name() if on_gpu else "cpu",
            "torch": torch.__version__, "triton": triton.__version__}
    for model in args.models.split(","):
        for name, (N, K) in SHAPES[model].items():
            torch.manual_seed(0)
            M = args.rows if on_gpu else 200
            if not on_gpu: N, K = min(N, 256), min(K, 3 * G + 48)     # the interpreter is slow: small, the last K block ragged
            x_hp = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            w_hp = (torch.randn(N, K, device=device) / K ** 0.5).to(torch.bfloat16)
            x_fp8 = quantize_1x128(x_hp)
            w = quantize(w_hp.float(), (G, G))
            w_scale = kernel_weight_scale(w)
            today = fp8_gemm_invariant(x_fp8, w, torch.bfloat16, w_scale=w_scale)
            flops = 2 * M * N * K
            row = {"model": model, "linear": name, "M": M, "N": N, "K": K, "default_tile": str(fp8_gemm_tiles(M, N, K)),
                   "today_us": graph_time_us(lambda: fp8_gemm_invariant(x_fp8, w, torch.bfloat16, w_scale=w_scale)),
                   "variants": {}}
            if on_gpu:
                row["cublas_fp8_us"] = graph_time_us(lambda: fp8_mm(x_fp8, w.t(), torch.bfloat16, b_kernel_scale=w_scale))
                row["cublas_bf16_us"] = graph_time_us(lambda: x_hp @ w_hp.t())
            for variant in variants:
                for tiles in tiles_list if on_gpu else tiles_list[:2]:
                    out = torch.empty_like(today)
                    try:
                        run_variant(variant, x_fp8, w.data, w_scale, out, tiles)
                        if on_gpu: torch.cuda.synchronize()
                    except Exception as e:          # unsupported here, or out of shared memory: not a candidate
                        row["variants"][f"{variant} {tiles}"] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
                        continue
                    same = torch.equal(out, today) if on_gpu else \
                        (out.float() - today.float()).abs().max().item() <= 1e-2 * today.float().abs().max().item()
                    us = graph_time_us(lambda: run_variant(variant, x_fp8, w.data, w_scale, out, tiles))
                    row["variants"][f"{variant} {tiles}"] = {"us": us, "same_bits": same}
                    if not same: print(f"!! {model} {name} {variant} {tiles}: OTHER BITS", flush=True)
            ok = {k: v["us"] for k, v in row["variants"].items() if "us" in v and v["same_bits"]}
            best = min(ok, key=ok.get) if ok else None
            row |= {"best": best, "best_us": ok.get(best)} | meta
            tf = lambda us: f"{flops / us / 1e6:5.0f} TF" if us == us else "  -  "
            print(f"{model:10s} {name:8s} today {row['today_us']:8.1f} us ({tf(row['today_us'])}) | best {best} "
                  f"{row['best_us'] or float('nan'):8.1f} us ({tf(row['best_us'] or float('nan'))})"
                  + (f" | cuBLAS fp8 {tf(row['cublas_fp8_us'])}, bf16 {tf(row['cublas_bf16_us'])}" if on_gpu else ""),
                  flush=True)
            errors = {k: v["error"] for k, v in row["variants"].items() if "error" in v}
            for k, e in list(errors.items())[:3]: print(f"   {k}: {e}", flush=True)
            if args.out:
                with open(args.out, "a") as f: f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    main()
