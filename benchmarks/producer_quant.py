"""The FP8 copies of a linear's input, launch by launch, on one GPU: which tiles and warps of the 1x128 quantizer,
the SiLU-mul and the RMSNorm are fastest at decode's rows and at the trainer's, each against the plain kernel then the
quantizer. (Session 15's run also timed an attention kernel writing the o projection's FP8 input: slower than the plain
kernel then `quantize_1x128` at decode and in the trainer, so not kept; its rows in the results are marked.)

    python benchmarks/producer_quant.py --out benchmarks/results/producer_quant_h200.jsonl

Each variant is checked against the default launch's bytes and scales: tiles and warps change no quantized byte (a
group's amax is a max, the division is per element). The norm's warps change the order of its sum, so there both of
its variants (with and without the copy) must give the same y at each warp count. Times: `graph_time_ms` (CUDA graph
replays, no host time)."""
import argparse, json, math, sys
import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from jetrl.fp8 import KERNEL_BLOCK, fp8_max                                           # noqa: E402
from jetrl.kernels import (_kernels, _fp8_buffers, graph_time_ms, group_tile_rows, next_power_of_2,  # noqa: E402
                           quantize_1x128, silu_mul as silu_mul_plain)

TINY = torch.finfo(torch.float32).tiny
E4M3_MAX = fp8_max("e4m3")
ROW_TILES, WARPS = (1, 2, 4, 8, 16, 32), (1, 2, 4, 8)


def quantize(x, block_m, warps):
    M, K = x.shape
    data, scale = _fp8_buffers(M, K, x, "e4m3")
    _kernels()["quantize_1x128"][(math.ceil(M / block_m), math.ceil(K / KERNEL_BLOCK))](
        x, data, scale, M, K, x.stride(0), x.stride(1), data.stride(0), *scale.stride(), FP8_MAX=E4M3_MAX, TINY=TINY,
        BLOCK_M=block_m, G=KERNEL_BLOCK, WIDE=False, num_warps=warps)
    return data, scale


def silu_mul(gate, up, block_m, warps):
    M, N = gate.shape
    y = torch.empty_like(gate)
    data, scale = _fp8_buffers(M, N, gate, "e4m3")
    _kernels()["silu_mul"][(math.ceil(M / block_m), math.ceil(N / KERNEL_BLOCK))](
        gate, up, y, data, scale, M, N, gate.stride(0), up.stride(0), y.stride(0), data.stride(0), *scale.stride(),
        FP8_MAX=E4M3_MAX, TINY=TINY, BLOCK_M=block_m, G=KERNEL_BLOCK, QUANTIZE=True, WIDE=False, CUDA_EXP=True,
        num_warps=warps)
    return y, data, scale


def norm(x, weight, warps, quantized):
    M, H = x.shape
    y = torch.empty_like(x)
    data, scale = _fp8_buffers(M, H, x, "e4m3") if quantized else (y, y)
    _kernels()["rms_norm"][(M,)](x, weight, y, data, scale, H, x.stride(0), y.stride(0), data.stride(0), *scale.stride(),
                                 1e-6, FP8_MAX=E4M3_MAX, TINY=TINY, BLOCK=max(next_power_of_2(H), KERNEL_BLOCK),
                                 G=KERNEL_BLOCK, QUANTIZE=quantized, num_warps=warps)
    return y, data, scale


def same(a, b) -> bool:
    return all(torch.equal(s.view(torch.uint8) if s.dtype.itemsize == 1 else s, t.view(torch.uint8) if t.dtype.itemsize == 1 else t)
               for s, t in zip(a, b))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    def emit(**row):
        rows.append(row); print(json.dumps(row), flush=True)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    for shape in ((128, 3584), (128, 18944), (256, 896), (256, 4864), (10240, 3584)):
        x = torch.randn(shape, **bf16)
        tile = group_tile_rows(shape[0])                      # the library's launch: the bytes every variant must give
        want = quantize(x, tile, 4)
        for bm in ROW_TILES:
            for w in WARPS:
                emit(kernel="quantize_1x128", shape=shape, block_m=bm, warps=w, us=round(1e3 * graph_time_ms(lambda: quantize(x, bm, w)), 2),
                     same_bits=same(quantize(x, bm, w), want), default=(bm, w) == (tile, 4))
    for shape in ((128, 18944), (256, 4864), (10240, 18944)):
        gate, up = torch.randn(shape, **bf16), torch.randn(shape, **bf16)
        tile = group_tile_rows(shape[0])
        want = silu_mul(gate, up, tile, 4)
        plain_then_quantize = graph_time_ms(lambda: quantize_1x128(silu_mul_plain(gate, up)))
        for bm in ROW_TILES:
            for w in WARPS:
                emit(kernel="silu_mul+fp8", shape=shape, block_m=bm, warps=w, us=round(1e3 * graph_time_ms(lambda: silu_mul(gate, up, bm, w)), 2),
                     same_bits=same(silu_mul(gate, up, bm, w), want), default=(bm, w) == (tile, 4),
                     plain_then_quantize_us=round(1e3 * plain_then_quantize, 2),
                     plain_us=round(1e3 * graph_time_ms(lambda: silu_mul_plain(gate, up)), 2))
    for shape in ((128, 3584), (256, 896), (10240, 3584), (10240, 896)):
        x, weight = torch.randn(shape, **bf16), torch.rand(shape[1], **bf16) + 0.5
        for w in (4, 8, 16):
            plain, fused = norm(x, weight, w, False), norm(x, weight, w, True)
            copy_ok = same(fused[1:], quantize(fused[0], group_tile_rows(shape[0]), 4))
            emit(kernel="rms_norm", shape=shape, warps=w, plain_us=round(1e3 * graph_time_ms(lambda: norm(x, weight, w, False)), 2),
                 fused_us=round(1e3 * graph_time_ms(lambda: norm(x, weight, w, True)), 2),
                 plain_then_quantize_us=round(1e3 * graph_time_ms(lambda: quantize_1x128(norm(x, weight, w, False)[0])), 2),
                 y_same_in_both=torch.equal(plain[0], fused[0]), copy_is_quantize_1x128=copy_ok, default=w == 4)
    if args.out:
        meta = dict(command="python benchmarks/producer_quant.py --out " + args.out, gpu=torch.cuda.get_device_name(), torch=torch.__version__)
        with open(args.out, "a") as f:
            for row in rows: f.write(json.dumps({**row, **meta}) + "\n")


if __name__ == "__main__":
    main()
