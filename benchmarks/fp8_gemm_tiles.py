"""Tile shapes of jetrl's batch-invariant FP8 GEMM against cuBLAS, at the GRPO step's shapes (one H200).

    python benchmarks/fp8_gemm_tiles.py --out benchmarks/results/fp8_gemm_tiles_h200.jsonl

For each (M, N, K) of a Qwen2 linear (trainer: 10,240 rows = 16 x 640 tokens; decode: 64 and 128 rows), times
every candidate tile of `jetrl.kernels.launch_fp8_gemm`, its FP8 tiles loaded by pointers and through TMA descriptors
(a tile or a load changes which program computes an output, never a bit: each candidate is checked equal to the
default), cuBLAS's blockwise FP8 GEMM (`torch._scaled_mm`, not batch
invariant) and cuBLAS BF16, all inside CUDA graphs (no launch gaps), and the activation quantizer at decode.
Prints one line per shape: the default tile, the fastest tile, cuBLAS FP8 and BF16, in microseconds and TFLOP/s.
"""
import argparse, json, math, sys, platform
import torch

from jetrl.fp8 import quantize, fp8_mm, kernel_weight_scale
from jetrl.kernels import (graph_time_ms, quantize_1x128, launch_fp8_gemm, fp8_gemm_tiles, tma_loads_possible,
                           loads_through_tma, next_power_of_2, DECODE_MAX_ROWS, TILE_ROWS)

SHAPES = {   # (N, K) per linear; q/k/v and gate/up also fused (their weights concatenated along N)
    "qwen2-7b": {"q/o": (3584, 3584), "k/v": (512, 3584), "qkv": (4608, 3584), "gate/up": (18944, 3584),
                 "gate+up": (37888, 3584), "down": (3584, 18944)},
    "qwen2-0.5b": {"q/o": (896, 896), "k/v": (128, 896), "qkv": (1152, 896), "gate/up": (4864, 896),
                   "gate+up": (9728, 896), "down": (896, 4864)},
}
TRAIN_TILES = [(128, 128, 8, 3, 8), (128, 128, 8, 4, 8), (128, 128, 8, 3, 1), (128, 64, 4, 4, 8), (128, 64, 4, 3, 8),
               (128, 64, 8, 4, 8), (64, 128, 4, 4, 8), (128, 256, 8, 3, 8), (256, 128, 8, 3, 8)]
DECODE_BLOCK_N = (32, 64, 128)
DECODE_WARPS, DECODE_STAGES = (4, 8), (3, 5)


def graph_time_us(fn, reps: int = 20, rounds: int = 5) -> float:
    "Median time of one call of fn in us, from a CUDA graph of `reps` calls replayed `rounds` times (jetrl's timer)."
    return 1e3 * graph_time_ms(fn, reps, rounds)


def measure(model: str, name: str, M: int, N: int, K: int, all_row_tiles: bool = False) -> dict:
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w_hp = (torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
    w = quantize(w_hp.float(), (128, 128))
    w_scale = kernel_weight_scale(w)
    x_fp8 = quantize_1x128(x)
    default = fp8_gemm_tiles(M, N, K)
    reference = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    launch_fp8_gemm(x_fp8.data, x_fp8.scale, w.data, w_scale, None, reference, default)
    if M <= DECODE_MAX_ROWS:        # the default's row tile, and all rows in one tile (past 128 rows: the weight read twice)
        row_tiles = sorted({default[0], max(TILE_ROWS, min(DECODE_MAX_ROWS, next_power_of_2(M)))}
                           | ({TILE_ROWS} if all_row_tiles else set()))          # 64-row tiles: twice the programs
        candidates = [(bm, bn, warps, stages, 1) for bm in row_tiles for bn in DECODE_BLOCK_N for warps in DECODE_WARPS
                      for stages in DECODE_STAGES]
    else:
        candidates = TRAIN_TILES
    if default not in candidates: candidates = [default] + candidates
    default_tma = loads_through_tma(M, default) and tma_loads_possible(x_fp8.data, w.data)   # launch_fp8_gemm's own choice
    tiles = {}
    for tile in candidates:
        for tma in (False, True):                     # the FP8 tiles loaded by pointers, or through TMA descriptors
            key = str(tile) + (" tma" if tma else "")
            out = torch.empty_like(reference)
            try:
                us = graph_time_us(lambda: launch_fp8_gemm(x_fp8.data, x_fp8.scale, w.data, w_scale, None, out, tile, tma=tma))
            except Exception as e:                    # out of shared memory, say: not a candidate on this GPU
                tiles[key] = {"error": type(e).__name__}; continue
            same = torch.equal(out, reference)
            tiles[key] = {"us": round(us, 2), "same_bits": same}
            if not same: print(f"!! {model} {name} M={M} tile {key}: OTHER BITS than the default tile", flush=True)
    default = str(default) + (" tma" if default_tma else "")
    flops = 2 * M * N * K
    row = {"model": model, "linear": name, "M": M, "N": N, "K": K, "default_tile": str(default), "tiles": tiles,
           "cublas_fp8_us": round(graph_time_us(lambda: fp8_mm(x_fp8, w.t(), torch.bfloat16, b_kernel_scale=w_scale)), 2),
           "cublas_bf16_us": round(graph_time_us(lambda: x @ w_hp.t()), 2)}
    if M <= 256: row["quantize_us"] = round(graph_time_us(lambda: quantize_1x128(x)), 2)
    ok = {t: v["us"] for t, v in tiles.items() if "us" in v and v["same_bits"]}
    best = min(ok, key=ok.get)
    row |= {"default_us": tiles[default].get("us"), "best_tile": best, "best_us": ok[best]}
    tf = lambda us: f"{flops / us / 1e6:6.0f}"
    print(f"{model:10s} {name:8s} M={M:5d} N={N:5d} K={K:5d} | default {row['default_us']:8.1f} us ({tf(row['default_us'])} TF) "
          f"| best {best} {ok[best]:8.1f} us ({tf(ok[best])} TF) | cuBLAS fp8 {row['cublas_fp8_us']:8.1f} ({tf(row['cublas_fp8_us'])}) "
          f"bf16 {row['cublas_bf16_us']:8.1f} ({tf(row['cublas_bf16_us'])})"
          + (f" | quantize {row['quantize_us']:.1f} us" if "quantize_us" in row else ""), flush=True)
    fastest = sorted(ok, key=ok.get)[:5]
    print("    fastest tiles (BLOCK_M, BLOCK_N, warps, stages, GROUP_M): " + ", ".join(f"{t} {ok[t]:.1f}" for t in fastest), flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen2-7b,qwen2-0.5b")
    p.add_argument("--rows", default="10240,64,128", help="M values: trainer micro-batch tokens, decode batch rows")
    p.add_argument("--linears", default=None, help="comma-separated names of SHAPES' linears (default: all)")
    p.add_argument("--decode-block-n", default=None, help="decode tiles' column widths to try, e.g. 16,32,64")
    p.add_argument("--decode-stages", default=None, help="decode tiles' pipeline stages to try, e.g. 3,6")
    p.add_argument("--decode-warps", default=None, help="decode tiles' warps to try, e.g. 4,8")
    p.add_argument("--all-row-tiles", action="store_true", help="at decode, also 64-row tiles (twice the programs)")
    p.add_argument("--out", default=None, help="append one JSON line per shape")
    args = p.parse_args(argv)
    global DECODE_BLOCK_N, DECODE_STAGES, DECODE_WARPS
    ints = lambda text: tuple(map(int, text.split(",")))
    if args.decode_block_n: DECODE_BLOCK_N = ints(args.decode_block_n)
    if args.decode_stages: DECODE_STAGES = ints(args.decode_stages)
    if args.decode_warps: DECODE_WARPS = ints(args.decode_warps)
    meta = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for model in args.models.split(","):
        for M in map(int, args.rows.split(",")):
            for name, (N, K) in SHAPES[model].items():
                if args.linears and name not in args.linears.split(","): continue
                row = measure(model, name, M, N, K, args.all_row_tiles) | meta
                if args.out:
                    with open(args.out, "a") as f: f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
