"""A decode FP8 GEMM that overlaps its K blocks' products, in the same K order (prototype; one H200).

    python benchmarks/gluon_decode_gemm.py --out benchmarks/results/gluon_decode_gemm_h200.jsonl

Why. jetrl's batch-invariant FP8 GEMM (`jetrl.kernels`, Triton) adds each output's K blocks of 128 one after the
other into an fp32 accumulator, each block's FP8 product rescaled by its two scales: the trainer's cuBLAS GEMM gives
those bits, so the rollout's decode must too. At decode (128 rows) a tile's chain of K blocks is the whole work of a
program, and Triton compiles each block's product as `wgmma` + `wgmma.wait_group 0`: the tensor cores hold one block
at a time, and a 7B down projection (148 blocks) streams its FP8 weight at ~1.5 TB/s (session 12, NOTES.md).

What this tries. The same products and the same additions in the same order, but block k + 1's product is issued
before block k's is rescaled and added (`warpgroup_mma(..., is_async=True)` then `warpgroup_mma_wait(1)`, in
Triton's Gluon), so two blocks are on the tensor cores at once while the loads stream through a ring of shared-memory
stages (TMA, one mbarrier a stage). Every candidate is checked bit for bit against `jetrl.kernels.launch_fp8_gemm` and
timed against it inside CUDA graphs (`jetrl.kernels.graph_time_ms`), at the 7B decode shapes (128 rows) and the 0.5B
ones (256 rows). Written in session 12; not yet measured: its one GPU run (session 12, the device time's last 3
minutes) hung in the first launch. The cause, found after: the prologue loaded STAGES - 1 blocks while the loop's
refills start at block STAGES, so block STAGES - 1 was never loaded and its stage's barrier never completed. Fixed
(the prologue loads STAGES blocks); compiled for sm_90 on the CPU since (`wgmma.wait_group 1` in the loop), not run.
A hang would show as no line printed: run it under `timeout`.
"""
import argparse, json, math, sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, warpgroup_mma, warpgroup_mma_wait

GROUP = 128          # K block, and the weight's block: jetrl's 1x128 x 128x128 recipe
WGMMA_K_FP8 = 32     # K of one FP8 wgmma instruction (256 bits of K per row)
WGMMA_M = 16         # rows of one wgmma instruction per warp (4 warps: 64 rows)


@gluon.jit
def fp8_gemm_overlapped(a_desc, w_desc, a_scale_ptr, w_scale_ptr, out_ptr, M, N, K, stride_a_scale, stride_w_scale,
                        stride_out, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        num_warps: gl.constexpr):
    # out = a @ w.T for a (M, K) in 1x128 groups and w (N, K) in 128x128 blocks; BLOCK_N divides 128, so a tile's
    # columns lie in one weight block and a K block has one weight scale for the whole tile (jetrl's ONE_WEIGHT_BLOCK)
    G: gl.constexpr = a_desc.block_type.shape[1]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, BLOCK_N, 32])
    pid = gl.program_id(0)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tile_m = pid // tiles_n
    tile_n = pid % tiles_n
    rows = tile_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
    cols = tile_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    row_ok = rows < M
    w_scale_row = w_scale_ptr + ((tile_n * BLOCK_N) // G) * stride_w_scale

    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, G], a_desc.layout)
    w_ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, G], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    stage_bytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
    blocks = gl.cdiv(K, G)
    for i in gl.static_range(STAGES):            # the first STAGES blocks' loads: block b lives in stage b % STAGES
        first = i < blocks
        mbarrier.expect(ready.index(i), stage_bytes, pred=first)
        tma.async_copy_global_to_shared(a_desc, [tile_m * BLOCK_M, i * G], ready.index(i), a_ring.index(i), pred=first)
        tma.async_copy_global_to_shared(w_desc, [tile_n * BLOCK_N, i * G], ready.index(i), w_ring.index(i), pred=first)

    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
    unused = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)   # use_acc=False: each block's product from zero
    mbarrier.wait(ready.index(0), 0)
    product = warpgroup_mma(a_ring.index(0), w_ring.index(0).permute((1, 0)), unused, use_acc=False, is_async=True)
    a_scale = gl.load(a_scale_ptr + rows * stride_a_scale, mask=row_ok, other=0.0)
    w_scale = gl.load(w_scale_row)
    for kb in range(1, blocks):
        stage = kb % STAGES
        mbarrier.wait(ready.index(stage), (kb // STAGES) & 1)
        following = warpgroup_mma(a_ring.index(stage), w_ring.index(stage).permute((1, 0)), unused, use_acc=False,
                                  is_async=True)
        a_scale_next = gl.load(a_scale_ptr + rows * stride_a_scale + kb, mask=row_ok, other=0.0)
        w_scale_next = gl.load(w_scale_row + kb)
        done = warpgroup_mma_wait(num_outstanding=1, deps=(product, ))   # block kb - 1's product; kb's still runs
        acc += done * (a_scale * w_scale)[:, None]                       # jetrl's promotion, in jetrl's order
        refill = kb - 1 + STAGES                 # into block kb - 1's stage, which its finished product has freed
        more = refill < blocks
        r = refill % STAGES
        mbarrier.expect(ready.index(r), stage_bytes, pred=more)
        tma.async_copy_global_to_shared(a_desc, [tile_m * BLOCK_M, refill * G], ready.index(r), a_ring.index(r),
                                        pred=more)
        tma.async_copy_global_to_shared(w_desc, [tile_n * BLOCK_N, refill * G], ready.index(r), w_ring.index(r),
                                        pred=more)
        product = following
        a_scale = a_scale_next
        w_scale = w_scale_next
    done = warpgroup_mma_wait(num_outstanding=0, deps=(product, ))
    acc += done * (a_scale * w_scale)[:, None]
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    out = acc.to(out_ptr.dtype.element_ty)
    gl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out, mask=row_ok[:, None] & (cols < N)[None, :])


def launch_overlapped(a_data, a_scale, w_data, w_scale, out, block_m: int, block_n: int, stages: int, warps: int = 4):
    "Run the prototype into `out` (M, N): a_data (M, K) and w_data (N, K) FP8 e4m3, w_scale in jetrl's kernel layout."
    (M, K), N = a_data.shape, w_data.shape[0]
    if GROUP % block_n or block_m != WGMMA_M * warps:
        raise ValueError(f"tiles of {WGMMA_M * warps} rows (one warp group's wgmma) and a width dividing {GROUP}: "
                         f"got {block_m} x {block_n} with {warps} warps")
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, GROUP], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, GROUP], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(a_data, [block_m, GROUP], a_layout)
    w_desc = TensorDescriptor.from_tensor(w_data, [block_n, GROUP], w_layout)
    grid = (math.ceil(M / block_m) * math.ceil(N / block_n), )
    fp8_gemm_overlapped[grid](a_desc, w_desc, a_scale, w_scale, out, M, N, K, a_scale.stride(0), w_scale.stride(0),
                              out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, num_warps=warps)
    return out


SHAPES = {   # (rows, {linear: (N, K)}) of the rollout's fused decode GEMMs
    "qwen2-7b": (128, {"qkv": (4608, 3584), "o": (3584, 3584), "gate+up": (37888, 3584), "down": (3584, 18944)}),
    "qwen2-0.5b": (256, {"qkv": (1152, 896), "o": (896, 896), "gate+up": (9728, 896), "down": (896, 4864)}),
}
CANDIDATES = [(64, 64, 4), (64, 64, 6), (64, 32, 4), (64, 32, 6), (64, 128, 4), (64, 16, 6)]   # (BLOCK_M, BLOCK_N, stages)


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
            w = quantize(torch.randn(N, K, device="cuda") / K ** 0.5, (GROUP, GROUP))
            w_scale = kernel_weight_scale(w)
            reference = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            tiles = fp8_gemm_tiles(M, N, K)
            launch_fp8_gemm(x.data, x.scale, w.data, w_scale, None, reference, tiles)
            triton_us = 1e3 * graph_time_ms(lambda: launch_fp8_gemm(x.data, x.scale, w.data, w_scale, None, reference, tiles))
            print(f"{model} {name}: jetrl's kernel {triton_us:.2f} us; the candidates ...", flush=True)   # a hang shows here
            row = {"model": model, "linear": name, "M": M, "N": N, "K": K, "triton_tile": str(tiles),
                   "triton_us": round(triton_us, 2), "candidates": {}}
            for block_m, block_n, stages in CANDIDATES:
                key = f"({block_m}, {block_n}, {stages})"
                out = torch.empty_like(reference)
                try:
                    launch_overlapped(x.data, x.scale, w.data, w_scale, out, block_m, block_n, stages)
                    torch.cuda.synchronize()
                except Exception as e:                 # a candidate this GPU or Triton cannot build: say which, go on
                    row["candidates"][key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}; continue
                same = torch.equal(out.view(torch.int16), reference.view(torch.int16))
                us = 1e3 * graph_time_ms(lambda: launch_overlapped(x.data, x.scale, w.data, w_scale, out, block_m,
                                                                    block_n, stages))
                row["candidates"][key] = {"us": round(us, 2), "same_bits": same}
            ok = {k: v["us"] for k, v in row["candidates"].items() if v.get("same_bits")}
            best = min(ok, key=ok.get) if ok else None
            row |= {"best": best, "best_us": ok.get(best), "speedup": round(triton_us / ok[best], 3) if best else None}
            totals.setdefault(model, [0.0, 0.0])
            totals[model][0] += triton_us; totals[model][1] += ok[best] if best else float("nan")
            print(f"{model:10s} {name:8s} M={M} N={N:5d} K={K:5d} | jetrl (Triton) {triton_us:7.2f} us | overlapped "
                  + ", ".join(f"{k} {v.get('us', v.get('error', ''))}{'' if v.get('same_bits', True) else ' OTHER BITS'}"
                              for k, v in row["candidates"].items()), flush=True)
            if args.out:
                with open(args.out, "a") as f: f.write(json.dumps(row | meta) + "\n")
    for model, (triton_us, best_us) in totals.items():
        print(f"{model}: a fused layer's decode GEMMs {triton_us:.1f} us (Triton) against {best_us:.1f} us (overlapped, "
              f"the best bitwise candidate per shape)")


if __name__ == "__main__":
    main()
