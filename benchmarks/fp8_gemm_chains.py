"""A candidate for the next FP8 GEMM: K summed in S interleaved chains, split over programs at decode, still bitwise.

    python benchmarks/fp8_gemm_chains.py --out benchmarks/results/fp8_gemm_chains_h200.jsonl

Why. The graphed 7B decode step spends 6.3 of its 9.3 ms in jetrl's FP8 GEMM (`profile_decode_7b_h200.txt`); the
down projection (K = 18,944: 148 blocks of 128, in one sequential chain per output tile) streams its weight at
~0.8 TB/s, because only N / BLOCK_N = 56 programs share the GPU's 132 SMs. Splitting K over programs would fill them,
but the trainer must add the partial sums in the same order, or the rollout leaves the trainer's policy. A split
into contiguous runs (session 4, `fp8_gemm_tiles_runs_h200.jsonl`) cost the trainer 10-20% (a nested K loop).

The candidate: block kb belongs to chain kb % S. Each chain is summed in order from zero (block by block, each block's
FP8 product rescaled by its two scales, DeepSeek-V3's promotion), and the S chain sums are added in chain order:
    total = ((chain_0 + chain_1) + chain_2) + ...
- The trainer computes all S chains in one program, in one flat loop over groups of S blocks (S accumulators: more
  independent tensor-core work in flight, which may even help it).
- Decode gives each chain a program of its own (S times the programs), writes the chain sums in fp32 and a small
  kernel adds them in chain order.
Both orders are the same, so a row's bits do not depend on the path: checked here bit for bit at every shape.
S = 1 is jetrl's kernel today (checked equal to `jetrl.kernels.fp8_gemm_invariant`).

Prints, per shape and S: the trainer-form time (10,240 rows) and the decode split time (64, 128 rows) against
today's kernel and cuBLAS, in CUDA graphs. If S > 1 wins at decode and costs the trainer nothing, it goes into
`jetrl.kernels` with S chosen from K alone (both sides see the same K).
"""
import argparse, json, math, sys
import torch
import triton
import triton.language as tl

from jetrl.fp8 import quantize, KERNEL_BLOCK
from jetrl.kernels import quantize_1x128, fp8_gemm_invariant, fp8_gemm_tiles

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from fp8_gemm_trainer import tile_of                               # jetrl's grouped tile order, as a Triton function

G = KERNEL_BLOCK


@triton.jit
def block_product(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, cols, row_ok, col_ok, kb, K, stride_a, stride_a_scale,
                  stride_w, stride_w_scale, G: tl.constexpr):
    # one 128-deep block: its FP8 product from zero, rescaled by the activation row's and the weight block's scales
    k = kb * G + tl.arange(0, G)
    k_ok = k < K
    a = tl.load(a_ptr + rows[:, None] * stride_a + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    w = tl.load(w_ptr + cols[:, None] * stride_w + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
    a_scale = tl.load(a_scale_ptr + rows * stride_a_scale + kb, mask=row_ok & (kb * G < K), other=0.0)
    w_scale = tl.load(w_scale_ptr + (cols // G) * stride_w_scale + kb, mask=col_ok & (kb * G < K), other=0.0)
    return tl.dot(a, tl.trans(w)) * (a_scale[:, None] * w_scale[None, :])


@triton.jit
def chain_gemm(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, M, N, K, stride_a, stride_a_scale, stride_w,
               stride_w_scale, stride_out, CHAINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               G: tl.constexpr, GROUP_M: tl.constexpr):
    # the trainer's form: every chain of one tile in one program (CHAINS in 1, 2, 4)
    tile_m, tile_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(tl.cdiv(K, G), CHAINS)):     # blocks past the last add an exact zero
        kb = g * CHAINS
        acc0 += block_product(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, cols, row_ok, col_ok, kb, K, stride_a,
                              stride_a_scale, stride_w, stride_w_scale, G)
        if CHAINS >= 2:
            acc1 += block_product(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, cols, row_ok, col_ok, kb + 1, K,
                                  stride_a, stride_a_scale, stride_w, stride_w_scale, G)
        if CHAINS >= 4:
            acc2 += block_product(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, cols, row_ok, col_ok, kb + 2, K,
                                  stride_a, stride_a_scale, stride_w, stride_w_scale, G)
            acc3 += block_product(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, cols, row_ok, col_ok, kb + 3, K,
                                  stride_a, stride_a_scale, stride_w, stride_w_scale, G)
    total = acc0
    if CHAINS >= 2: total = total + acc1
    if CHAINS >= 4:
        total = total + acc2
        total = total + acc3
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], total.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def chain_gemm_split(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, sums_ptr, M, N, K, stride_a, stride_a_scale, stride_w,
                     stride_w_scale, CHAINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr):
    # decode's form: one program per (tile, chain), the chain's sum written in fp32 to sums_ptr (CHAINS, M, N)
    pid = tl.program_id(0)
    chain, tile = pid % CHAINS, pid // CHAINS
    tiles_n = tl.cdiv(N, BLOCK_N)
    rows = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(chain, tl.cdiv(K, G), CHAINS):
        acc += block_product(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, cols, row_ok, col_ok, kb, K, stride_a,
                             stride_a_scale, stride_w, stride_w_scale, G)
    tl.store(sums_ptr + chain * M * N + rows[:, None] * N + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def add_chains(sums_ptr, out_ptr, MN, CHAINS: tl.constexpr, BLOCK: tl.constexpr):
    # the chain sums added in chain order: the trainer's `total`
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    total = tl.load(sums_ptr + i, mask=ok, other=0.0)
    for c in tl.static_range(1, CHAINS):
        total = total + tl.load(sums_ptr + c * MN + i, mask=ok, other=0.0)
    tl.store(out_ptr + i, total.to(out_ptr.dtype.element_ty), mask=ok)


def trainer_form(x_fp8, w, chains: int, tiles) -> torch.Tensor:
    (M, K), N = x_fp8.shape, w.shape[0]
    block_m, block_n, warps, stages, group_m = tiles
    out = torch.empty(M, N, device=x_fp8.data.device, dtype=torch.bfloat16)
    a_scale = x_fp8.scale.contiguous()      # these forms read the scales row-major (jetrl's quantizers: column-major)
    chain_gemm[(math.ceil(M / block_m) * math.ceil(N / block_n),)](
        x_fp8.data, a_scale, w.data, w.scale, out, M, N, K, x_fp8.data.stride(0), a_scale.stride(0),
        w.data.stride(0), w.scale.stride(0), out.stride(0), CHAINS=chains, BLOCK_M=block_m, BLOCK_N=block_n, G=G,
        GROUP_M=group_m, num_warps=warps, num_stages=stages)
    return out


def decode_form(x_fp8, w, chains: int, block_n: int, warps: int, stages: int) -> torch.Tensor:
    (M, K), N = x_fp8.shape, w.shape[0]
    block_m = max(64, triton.next_power_of_2(M))
    sums = torch.empty(chains, M, N, device=x_fp8.data.device, dtype=torch.float32)
    out = torch.empty(M, N, device=x_fp8.data.device, dtype=torch.bfloat16)
    a_scale = x_fp8.scale.contiguous()      # row-major, as above
    chain_gemm_split[(math.ceil(M / block_m) * math.ceil(N / block_n) * chains,)](
        x_fp8.data, a_scale, w.data, w.scale, sums, M, N, K, x_fp8.data.stride(0), a_scale.stride(0),
        w.data.stride(0), w.scale.stride(0), CHAINS=chains, BLOCK_M=block_m, BLOCK_N=block_n, G=G,
        num_warps=warps, num_stages=stages)
    add_chains[(math.ceil(M * N / 1024),)](sums, out, M * N, CHAINS=chains, BLOCK=1024)
    return out


SHAPES = {"qwen2-7b": {"q/o": (3584, 3584), "gate/up": (18944, 3584), "down": (3584, 18944)},
          "qwen2-0.5b": {"q/o": (896, 896), "gate/up": (4864, 896), "down": (896, 4864)}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen2-7b,qwen2-0.5b")
    p.add_argument("--train-rows", type=int, default=10240)
    p.add_argument("--decode-rows", default="64,128")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    if on_gpu: from fp8_gemm_tiles import graph_time_us
    else: graph_time_us = lambda fn: float("nan")                     # TRITON_INTERPRET=1 on a CPU: bits only
    meta = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name() if on_gpu else "cpu",
            "torch": torch.__version__}
    for model in args.models.split(","):
        for name, (N, K) in SHAPES[model].items():
            torch.manual_seed(0)
            M_train = args.train_rows if on_gpu else 130
            x_fp8 = quantize_1x128(torch.randn(M_train, K, device=device, dtype=torch.bfloat16))
            w = quantize((torch.randn(N, K, device=device) / K ** 0.5), (G, G))
            today = fp8_gemm_invariant(x_fp8, w, torch.bfloat16)
            tiles = fp8_gemm_tiles(M_train, N, K)
            row = {"model": model, "linear": name, "N": N, "K": K, "train_rows": M_train,
                   "today_train_us": graph_time_us(lambda: fp8_gemm_invariant(x_fp8, w, torch.bfloat16))}
            for chains in (1, 2, 4):
                trained = trainer_form(x_fp8, w, chains, tiles)
                if chains == 1 and on_gpu: assert torch.equal(trained, today), f"{model} {name}: S = 1 is not today's kernel"
                row[f"train_S{chains}_us"] = graph_time_us(lambda: trainer_form(x_fp8, w, chains, tiles))
                for M in map(int, args.decode_rows.split(",")):
                    part = type(x_fp8)(x_fp8.data[:M], x_fp8.scale[:M], x_fp8.block, x_fp8.fmt)
                    for block_n, warps, stages in ((32, 8, 3), (64, 8, 4), (64, 4, 4), (128, 8, 3)):
                        decoded = decode_form(part, w, chains, block_n, warps, stages)
                        same = torch.equal(decoded, trained[:M]) if on_gpu else \
                            (decoded.float() - trained[:M].float()).abs().max().item() < 1e-2 * trained.float().abs().max().item()
                        if not same: print(f"!! {model} {name} S={chains} M={M} {block_n}/{warps}/{stages}: OTHER BITS", flush=True)
                        key = f"decode{M}_S{chains}_{block_n}x{warps}x{stages}"
                        row[key] = {"us": graph_time_us(lambda: decode_form(part, w, chains, block_n, warps, stages)), "same_bits": same}
            for M in map(int, args.decode_rows.split(",")):
                part = type(x_fp8)(x_fp8.data[:M], x_fp8.scale[:M], x_fp8.block, x_fp8.fmt)
                row[f"today_decode{M}_us"] = graph_time_us(lambda: fp8_gemm_invariant(part, w, torch.bfloat16))
            row |= meta
            best = {M: min(((k, v["us"]) for k, v in row.items() if k.startswith(f"decode{M}_") and v["same_bits"]),
                           key=lambda kv: kv[1]) for M in map(int, args.decode_rows.split(","))}
            print(f"{model:10s} {name:8s} train today {row['today_train_us']:8.1f} us, S=2 {row['train_S2_us']:8.1f}, "
                  f"S=4 {row['train_S4_us']:8.1f} | " + " | ".join(
                      f"decode {M}: today {row[f'today_decode{M}_us']:6.1f}, best {k.split('_', 1)[1]} {us:6.1f}"
                      for M, (k, us) in best.items()), flush=True)
            if args.out:
                with open(args.out, "a") as f: f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
