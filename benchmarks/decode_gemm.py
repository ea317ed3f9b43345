"""Decode's FP8 GEMMs at a model's shapes: the engine's default kernel and tile against every candidate tile of the two
FP8 kernels, cuBLAS's BF16 and FP8 GEMMs, and the bytes bound, with a same-bits check of every candidate.

    python -m benchmarks decode_gemm --model llama3-8b --rows 64 --out benchmarks/results/decode_gemm_h200.jsonl
    python -m benchmarks decode_gemm --model llama3-8b --rows 64 --no-sweep      # the default path and baselines only

A decode step's linears are GEMMs of a few rows (`--rows`, the rollout's batch) by a weight: they read the weight once
and are bound by memory. One row per linear of the model (the fused q/k/v and gate/up projections as `jet` runs them,
the output and down projections): the time of the default path (`fp8_gemm_invariant`, what the engine calls), of
each candidate tile of the Triton kernel (`launch_fp8_gemm`: BLOCK_M x BLOCK_N, warps, stages, TMA or pointer
loads) and of the Gluon overlapped kernel (`launch_decode_overlapped`: `OverlappedTile`), each with `same_bits`
(its output equals the default's bit for bit; tiles change no bits), against the bound (the FP8 weight and its scales,
the FP8 activations, the output, at the GPU's memory bandwidth: `hbm_bytes_per_s`) and against cuBLAS's BF16 GEMM of the
same shape (what `bf16` runs) and its bound; then one row per row count with the layer's GEMMs summed
(`linear: "layer"`). Times are CUDA graph replays of calls that cycle through enough copies of the weight to exceed the
GPU's L2 cache, as a decode step reads each layer's weights once (a GEMM repeated on one weight would find it in L2).
"""
import argparse, itertools, math
import torch

from benchmarks.common import RANDOM_MODELS, add_output_args, emit, hbm_bytes_per_s, make_row, need_cuda
from jetrl.fp8 import KERNEL_BLOCK, kernel_weight_scale, _fp8_gemm
from jetrl.kernels import decode_gemm, gemm
from jetrl.kernels.quantize import quantize_1x128, quantize_128x128
from jetrl.kernels.support import graph_time_ms, same_bits, tma_loads_possible

L2_FLUSH_BYTES = 256 * 2**20     # weight copies cycled per timed call: more than the L2 of an H100 / H200 (50-60 MB)


def triton_tiles(M: int) -> list[tuple]:
    "Candidate (BLOCK_M, BLOCK_N, warps, stages, GROUP_M) of the Triton kernel for M rows: 64-row tiles, and 128 past 64 rows."
    heights = (64,) if M <= 64 else (64, 128)
    return [(m, n, w, s, 1) for m, n, w, s in itertools.product(heights, (32, 64, 128), (4, 8), (3, 5))]


def gluon_tiles(M: int) -> list:
    "Candidate `OverlappedTile`s for M rows that the overlapped kernel can build (`check_overlapped_tile`)."
    heights = (64,) if M <= 64 else (64, 128)
    tiles = [decode_gemm.OverlappedTile(m, cols, groups, unroll, stages) for m, cols, groups, unroll, stages in
             itertools.product(heights, (32, 64, 128), (1, 2), (4, 8), (4, 8, 12, 16))]
    return list(filter(gluon_tile_fits, tiles))


def linear_shapes(model: str) -> dict[str, tuple[int, int]]:
    "(N, K) of each decode GEMM of a `RANDOM_MODELS` shape: fused q/k/v, the attention output, fused gate/up, down."
    c = RANDOM_MODELS[model]
    hidden, heads, kv_heads = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = hidden // heads
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate+up": (2 * c["intermediate_size"], hidden), "down": (hidden, c["intermediate_size"])}


def gluon_tile_fits(tile) -> bool:
    try: decode_gemm.check_overlapped_tile(tile)
    except ValueError: return False
    return True


def time_cycled_us(call, copies: int) -> float:
    "GPU us of one call(i) as calls i = 0, 1, ..., copies - 1 replay from one CUDA graph."
    state = {"i": 0}
    def next_call():
        call(state["i"] % copies); state["i"] += 1
    return 1e3 * graph_time_ms(next_call, calls=max(copies, 20))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks decode_gemm", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3-8b", choices=sorted(RANDOM_MODELS))
    p.add_argument("--rows", default="64", help="the rollout's batch: rows of each decode GEMM (comma-separated: one pass each)")
    p.add_argument("--linears", default=None, help="comma-separated subset of qkv,o,gate+up,down (default: all)")
    p.add_argument("--no-sweep", action="store_true", help="the default path and the baselines only")
    add_output_args(p, kernels=False)
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r.strip().isdigit()]
    if not rows or len(rows) != len(args.rows.split(",")) or not all(0 < r <= gemm.DECODE_MAX_ROWS for r in rows):
        raise SystemExit(f"--rows takes whole numbers 1-{gemm.DECODE_MAX_ROWS} (decode GEMMs), comma-separated: got {args.rows!r}")
    shapes = linear_shapes(args.model)
    wanted = shapes if args.linears is None else args.linears.split(",")
    unknown = [n for n in wanted if n not in shapes]
    if unknown: raise SystemExit(f"--linears: unknown {unknown}; the linears are {', '.join(shapes)}")
    need_cuda("decode_gemm")
    device = torch.device("cuda")
    bandwidth, bandwidth_source = hbm_bytes_per_s(device)
    g = torch.Generator(device=device).manual_seed(0)
    layers = {}                     # rows -> the per-GEMM rows of that batch, summed into one row per layer at the end
    for M, name in itertools.product(rows, wanted):
        N, K = shapes[name]
        copies = max(2, math.ceil(L2_FLUSH_BYTES / (N * K)))
        x = torch.randn(M, K, device=device, generator=g, dtype=torch.bfloat16)
        a = quantize_1x128(x)
        weights = [torch.randn(N, K, device=device, generator=g, dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
        w_fp8 = [quantize_128x128(w) for w in weights]
        w_scale = [kernel_weight_scale(w) for w in w_fp8]
        out = torch.empty(M, N, device=device, dtype=torch.bfloat16)
        reference = gemm.fp8_gemm_invariant(a, w_fp8[0], torch.bfloat16, w_scale[0])
        fp8_bytes = N * K + w_fp8[0].scale.numel() * 4 + M * K + a.scale.numel() * 4 + M * N * 2
        bound_us = 1e6 * fp8_bytes / bandwidth
        bf16_bound_us = 1e6 * (2 * N * K + 2 * M * K + 2 * M * N) / bandwidth
        timed = {}
        def candidate(label, launch):
            try:
                launch(0)
                same = same_bits(out, reference)
                timed[label] = dict(us=round(time_cycled_us(launch, copies), 3), same_bits=same)
            except Exception as e:   # a tile this GPU cannot build or run is recorded, not fatal
                timed[label] = dict(error=f"{type(e).__name__}: {str(e)[:120]}")
        default_us = time_cycled_us(lambda i: gemm.fp8_gemm_invariant(a, w_fp8[i], torch.bfloat16, w_scale[i]), copies)
        launches = decode_gemm.launches            # the overlapped kernel counts its launches: which path the default took
        gemm.fp8_gemm_invariant(a, w_fp8[0], torch.bfloat16, w_scale[0])
        gluon_tile = (decode_gemm.overlapped_tile_for(M, N, gemm.sm_count(device))
                      if decode_gemm.launches > launches else None)
        triton_tiles_now = gemm.fp8_gemm_tiles(M, N, K)
        default_kernel = (f"gluon {tuple(gluon_tile)}" if gluon_tile is not None else
                          f"triton {triton_tiles_now}{' tma' if gemm.loads_through_tma(M, triton_tiles_now) else ''}")
        bf16_x = x.clone()
        bf16_us = time_cycled_us(lambda i: torch.mm(bf16_x, weights[i].t()), copies)
        try:
            fp8_cublas_us = time_cycled_us(lambda i: _fp8_gemm(a.data, a.scale, w_fp8[i].data, w_scale[i],
                                                               gemm.CUBLAS_BLOCKWISE_LAYOUT, torch.bfloat16), copies)
        except RuntimeError: fp8_cublas_us = None
        if not args.no_sweep:
            for tiles in triton_tiles(M):
                for tma in (False, True):
                    if tma and not tma_loads_possible(a.data, w_fp8[0].data): continue
                    candidate(f"triton {tiles}{' tma' if tma else ''}", lambda i, t=tiles, m=tma: gemm.launch_fp8_gemm(
                        a.data, a.scale, w_fp8[i].data, w_scale[i], None, out, t, tma=m))
            if decode_gemm.gluon_decode_possible(a.data, w_fp8[0].data, out):
                for tile in gluon_tiles(M):
                    candidate(f"gluon {tuple(tile)}", lambda i, t=tile: decode_gemm.launch_decode_overlapped(
                        a.data, a.scale, w_fp8[i].data, w_scale[i], None, out, t))
        ok = {k: v["us"] for k, v in timed.items() if v.get("same_bits")}
        best = min(ok.items(), key=lambda kv: kv[1]) if ok else (None, None)
        layers.setdefault(M, []).append(emit(make_row("decode_gemm", dict(
            model=args.model, linear=name, M=M, N=N, K=K, hbm_tb_per_s=bandwidth / 1e12, bandwidth_source=bandwidth_source,
            weight_copies=copies, default_kernel=default_kernel, default_us=default_us, bound_us=bound_us,
            default_over_bound=default_us / bound_us, best=best[0], best_us=best[1],
            best_over_bound=None if best[1] is None else best[1] / bound_us,
            bf16_cublas_us=bf16_us, bf16_bound_us=bf16_bound_us, bf16_over_bound=bf16_us / bf16_bound_us,
            fp8_cublas_us=fp8_cublas_us, default_speedup_vs_bf16=bf16_us / default_us,
            not_same_bits=sorted(k for k, v in timed.items() if v.get("same_bits") is False),
            candidates=timed), argv, device), args.out))
    for M, per_gemm in layers.items():   # a layer's GEMMs together: what one decode step pays per layer
        total = {k: sum(r[k] for r in per_gemm) for k in ("default_us", "bound_us", "bf16_cublas_us")}
        best_all = None if any(r["best_us"] is None for r in per_gemm) else sum(r["best_us"] for r in per_gemm)
        emit(make_row("decode_gemm", dict(
            model=args.model, linear="layer", linears=[r["linear"] for r in per_gemm], M=M, **total,
            default_over_bound=total["default_us"] / total["bound_us"], best_us=best_all,
            default_speedup_vs_bf16=total["bf16_cublas_us"] / total["default_us"]), argv, device), args.out)


if __name__ == "__main__":
    main()
