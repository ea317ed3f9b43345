"""A decode FP8 GEMM that overlaps its K blocks' products, in the same K order (prototype; one H200).

    python benchmarks/gluon_decode_gemm.py --out benchmarks/results/gluon_decode_gemm_h200.jsonl

Why. jetrl's batch-invariant FP8 GEMM (`jetrl.kernels`, Triton) adds each output's K blocks of 128 one after the
other into an fp32 accumulator, each block's FP8 product rescaled by its two scales: the trainer's cuBLAS GEMM gives
those bits, so the rollout's decode must too. At decode (128 rows) a tile's chain of K blocks is the whole work of a
program, and Triton compiles each block's product as `wgmma` + `wgmma.wait_group 0`: the tensor cores hold one block
at a time, and a 7B down projection (148 blocks) streams its FP8 weight at ~1.5 TB/s (session 12, NOTES.md).

What this tries (`jetrl.gluon_kernels`, `nbs/00c_gluon_kernels.ipynb`). The same products and the same additions in
the same order, but block k + 1's product is issued before block k's is rescaled and added (`warpgroup_mma(...,
is_async=True)` then `warpgroup_mma_wait(1)`, in Triton's Gluon), in chunks of `unroll` blocks, while the loads stream
through a ring of shared-memory stages (TMA, one mbarrier a stage). Every candidate tile (`OverlappedTile`: rows,
cols, col_groups, unroll, stages) is checked bit for bit against `jetrl.kernels.launch_fp8_gemm` and timed against it
inside CUDA graphs (`jetrl.kernels.graph_time_ms`), at the 7B decode shapes (128 rows) and the 0.5B ones (256 rows).
History: session 12's first build (the whole K loop unrolled) was 2x slower than the Triton kernel on the H200
(session 13, call 1: rows without "tile" keys); the chunked loop replaced it. A hang shows as a shape's first line
with nothing after it: run it under `timeout`.
"""
import argparse, json, sys

import torch
import triton

from jetrl.gluon_kernels import OverlappedTile, launch_decode_overlapped

SHAPES = {   # (rows, {linear: (N, K)}) of the rollout's fused decode GEMMs
    "qwen2-7b": (128, {"qkv": (4608, 3584), "o": (3584, 3584), "gate+up": (37888, 3584), "down": (3584, 18944)}),
    "qwen2-0.5b": (256, {"qkv": (1152, 896), "o": (896, 896), "gate+up": (9728, 896), "down": (896, 4864)}),
}
CANDIDATES = [OverlappedTile(*t) for t in [      # (rows, cols, col_groups, unroll, stages)
    (64, 16, 1, 4, 6), (64, 32, 1, 4, 6), (64, 32, 1, 8, 8), (64, 64, 1, 4, 6), (64, 64, 2, 4, 6), (64, 64, 2, 8, 8),
    (128, 32, 1, 4, 6), (128, 64, 1, 4, 6), (128, 64, 1, 8, 8), (128, 64, 1, 2, 4)]]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen2-7b,qwen2-0.5b")
    p.add_argument("--out", default=None, help="append one JSON line per shape")
    args = p.parse_args(argv)
    from jetrl.fp8 import quantize, kernel_weight_scale
    from jetrl.kernels import quantize_1x128, launch_fp8_gemm, fp8_gemm_tiles, graph_time_ms
    meta = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__}
    totals = {}
    for model in args.models.split(","):
        M, linears = SHAPES[model]
        for name, (N, K) in linears.items():
            torch.manual_seed(0)
            x = quantize_1x128(torch.randn(M, K, device="cuda", dtype=torch.bfloat16))
            w = quantize(torch.randn(N, K, device="cuda") / K ** 0.5, (128, 128))
            w_scale = kernel_weight_scale(w)
            reference = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            tiles = fp8_gemm_tiles(M, N, K)
            launch_fp8_gemm(x.data, x.scale, w.data, w_scale, None, reference, tiles)
            triton_us = 1e3 * graph_time_ms(lambda: launch_fp8_gemm(x.data, x.scale, w.data, w_scale, None, reference, tiles))
            print(f"{model} {name}: jetrl's kernel {triton_us:.2f} us; the candidates ...", flush=True)   # a hang shows here
            row = {"model": model, "linear": name, "M": M, "N": N, "K": K, "triton_tile": str(tiles),
                   "triton_us": round(triton_us, 2), "candidates": {}}
            for tile in CANDIDATES:
                key = str(tuple(tile)) + (" default" if tile == OverlappedTile() else "")
                out = torch.empty_like(reference)
                try:
                    launch_decode_overlapped(x.data, x.scale, w.data, w_scale, None, out, tile)
                    torch.cuda.synchronize()
                except Exception as e:                 # a candidate this GPU or Triton cannot build: say which, go on
                    row["candidates"][key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}; continue
                same = torch.equal(out.view(torch.int16), reference.view(torch.int16))
                us = 1e3 * graph_time_ms(lambda: launch_decode_overlapped(x.data, x.scale, w.data, w_scale, None, out,
                                                                          tile))
                row["candidates"][key] = {"us": round(us, 2), "same_bits": same}
            ok = {k: v["us"] for k, v in row["candidates"].items() if v.get("same_bits")}
            best = min(ok, key=ok.get) if ok else None
            row |= {"best": best, "best_us": ok.get(best), "speedup": round(triton_us / ok[best], 3) if best else None}
            totals.setdefault(model, [0.0, 0.0])
            totals[model][0] += triton_us; totals[model][1] += ok[best] if best else float("nan")
            ranked = sorted(row["candidates"].items(), key=lambda kv: kv[1].get("us", float("inf")))
            print(f"{model:10s} {name:8s} M={M} N={N:5d} K={K:5d} | jetrl (Triton) {triton_us:7.2f} us | overlapped "
                  + ", ".join(f"{k} {v.get('us', v.get('error', ''))}{'' if v.get('same_bits', True) else ' OTHER BITS'}"
                              for k, v in ranked), flush=True)
            if args.out:
                with open(args.out, "a") as f: f.write(json.dumps(row | meta) + "\n")
    for model, (triton_us, best_us) in totals.items():
        print(f"{model}: a fused layer's decode GEMMs {triton_us:.1f} us (Triton) against {best_us:.1f} us (overlapped, "
              f"the best bitwise candidate per shape)")


if __name__ == "__main__":
    main()
