"""The GPU speed bounds: each kernel jetrl runs by default against what it replaces, timed, and bounded.

    python -m benchmarks speed_check                                    # every check; exit status 1 if one fails
    python -m benchmarks speed_check --only rotary,head_log_probs --out benchmarks/results/speed_check_h200.jsonl

The correctness of these kernels (bits, bytes, tolerances) is tested in tests/test_gpu.py; here only their time. Each
case is one row: `kernel_ms` (what jetrl runs), `reference_ms` (what it replaces: torch's ops, the separate passes,
cuBLAS BF16, or the Triton kernel), `time_ratio` = kernel / reference and its bound `max_time_ratio`, and `passed`.
GPU time from CUDA graphs (`graph_time_ms`: calls captured in one graph and replayed; no host time) unless a row says
`timing: events` (eager calls between CUDA events, host launches included). The bounds sit well inside what an H200
measured (benchmarks/README.md has the measurements): a check fails on a real regression (a kernel that lost its
single pass, a trainer GEMM that fell back from cuBLAS), not on run-to-run noise. Needs a CUDA GPU (Hopper).
"""
import argparse, sys
import torch

from benchmarks.common import (LINEAR_SHAPES, TRAINER_TOKENS, add_output_args, emit, event_time_ms, graph_time_ms,
                               make_row, need_cuda)
from jetrl.fp8 import kernel_weight_scale, quantize, quantize_unchecked
from jetrl.options import KernelOptions, kernel_options, use_kernel_options

CHECKS = {}


def check(name: str):
    "Register a check: a function yielding (case, kernel_ms, reference_ms, max_time_ratio[, timing])."
    def register(fn):
        CHECKS[name] = fn
        return fn
    return register


def weights(N: int, K: int):
    "(FP8 128x128 weight, its kernel scale, the same weight in bf16) of a random (N, K) linear."
    w_hp = torch.randn(N, K, device="cuda") / K ** 0.5
    w = quantize(w_hp, (128, 128))
    return w, kernel_weight_scale(w), w_hp.to(torch.bfloat16)


def us_graph(fn) -> float:
    return graph_time_ms(fn, calls=20, rounds=5)


def bf16(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


# ---------------------------------------------------------------- the FP8 backward's quantizers
# The library's passes (dy in two quantize_1x128 passes, Wgrad's x requantized from its FP8 copy) against the four
# passes they replace (x dequantized and quantized again along the tokens), eager, per 7B linear (K, N).
BACKWARD_QUANT_MAX_TIME_RATIO = {(3584, 18944): 0.85, (18944, 3584): 0.45, (3584, 3584): 0.75}
# dy's two quantize_1x128 passes against the one-pass dual kernel, where it exists: the default must stay the faster.
DY_TWO_PASSES_MAX_TIME_RATIO = 0.9


@check("backward_quantizers")
def backward_quantizers():
    from jetrl.grad_kernels import requantize_for_wgrad
    from jetrl.kernels import quantize_1x128
    for (K, N), bound in BACKWARD_QUANT_MAX_TIME_RATIO.items():
        torch.manual_seed(0)
        dy, x_fp8 = bf16(TRAINER_TOKENS, N), quantize_1x128(bf16(TRAINER_TOKENS, K))
        old = lambda: (quantize_1x128(dy), quantize_1x128(dy.t()), quantize_1x128(x_fp8.dequantize(torch.bfloat16).t()))
        new = lambda: (quantize_1x128(dy), quantize_1x128(dy.t()), requantize_for_wgrad(x_fp8, torch.bfloat16))
        yield f"7B K={K} N={N}", event_time_ms(new), event_time_ms(old), bound, "events"


@check("dy_two_passes")
def dy_two_passes():
    import jetrl.grad_kernels as grad_kernels
    one_pass = getattr(grad_kernels, "quantize_dual_1x128", None)
    if one_pass is None: return                                   # no one-pass kernel to compare with
    from jetrl.kernels import quantize_1x128
    for N in (4608, 18944, 896):                                  # 7B qkv, 7B gate/up, 0.5B q/o
        torch.manual_seed(0)
        dy = bf16(TRAINER_TOKENS, N)
        yield (f"dy ({TRAINER_TOKENS}, {N})", us_graph(lambda: (quantize_1x128(dy), quantize_1x128(dy.t()))),
               us_graph(lambda: one_pass(dy)), DY_TWO_PASSES_MAX_TIME_RATIO)


# ---------------------------------------------------------------- the forward FP8 GEMM
TRAINER_SHAPES_7B = [LINEAR_SHAPES["qwen2-7b"][k] for k in ("q/o", "gate/up", "down")]
TRAINER_FP8_GEMM_MAX_TIME_VS_BF16 = 0.95     # the Triton kernel (where cuBLAS does not give its bits) vs cuBLAS BF16
CUBLAS_TRAINER_GEMM_MAX_TIME_VS_KERNEL = 0.95      # the trainer's GEMM (cuBLAS, its bits checked) vs the kernel, each
CUBLAS_TRAINER_GEMMS_MAX_TIME_VS_KERNEL = 0.85     # ... and the three 7B shapes together
DECODE_FP8_LAYER_MAX_TIME_VS_BF16 = 1.0      # a 7B decode layer's FP8 GEMMs at 128 rows vs cuBLAS BF16's


def _fp8_gemm_us(x_fp8, w, w_scale, options: KernelOptions | None = None) -> float:
    from jetrl.kernels import fp8_gemm_invariant
    with use_kernel_options(options or kernel_options()):
        return us_graph(lambda: fp8_gemm_invariant(x_fp8, w, torch.bfloat16, w_scale))


@check("trainer_fp8_gemm")
def trainer_fp8_gemm():
    from jetrl.kernels import quantize_1x128
    kernel_only = KernelOptions(cublas_when_same_bits=False)
    totals = [0.0, 0.0]
    for N, K in TRAINER_SHAPES_7B:
        torch.manual_seed(0)
        x = bf16(TRAINER_TOKENS, K)
        x_fp8, (w, w_scale, w_bf16) = quantize_1x128(x), weights(N, K)
        kernel = _fp8_gemm_us(x_fp8, w, w_scale, kernel_only)
        yield f"Triton kernel vs cuBLAS BF16, M={TRAINER_TOKENS} N={N} K={K}", kernel, us_graph(lambda: x @ w_bf16.t()), \
            TRAINER_FP8_GEMM_MAX_TIME_VS_BF16
        default = _fp8_gemm_us(x_fp8, w, w_scale)
        yield f"default (cuBLAS) vs Triton kernel, M={TRAINER_TOKENS} N={N} K={K}", default, kernel, \
            CUBLAS_TRAINER_GEMM_MAX_TIME_VS_KERNEL
        totals[0] += default; totals[1] += kernel
    yield "default (cuBLAS) vs Triton kernel, three 7B shapes", totals[0], totals[1], CUBLAS_TRAINER_GEMMS_MAX_TIME_VS_KERNEL


@check("decode_layer_gemms")
def decode_layer_gemms():
    from jetrl.kernels import quantize_1x128, fp8_gemm_invariant
    rows, hidden, kv, mlp = 128, 3584, 512, 18944
    torch.manual_seed(0)
    x, h = bf16(rows, hidden), bf16(rows, mlp)
    x_fp8, h_fp8 = quantize_1x128(x), quantize_1x128(h)
    fp8 = [(x_fp8, weights(n, hidden)) for n in (hidden + 2 * kv, hidden, 2 * mlp)] + [(h_fp8, weights(hidden, mlp))]
    plain = [(x, weights(n, hidden)[2]) for n in (hidden, kv, kv, hidden, mlp, mlp)] + [(h, weights(hidden, mlp)[2])]
    yield ("7B layer at 128 rows: FP8 q/k/v, o, gate+up, down vs cuBLAS BF16's seven",
           us_graph(lambda: [fp8_gemm_invariant(a, w, torch.bfloat16, s) for a, (w, s, _) in fp8]),
           us_graph(lambda: [a @ w.t() for a, w in plain]), DECODE_FP8_LAYER_MAX_TIME_VS_BF16)


GLUON_DECODE_MIN_SPEEDUP = 1.1     # the overlapped decode GEMM vs the Triton kernel at the down projections it takes


@check("gluon_decode")
def gluon_decode():
    import jetrl.kernels as kernels
    gluon = getattr(kernels, "launch_decode_overlapped", None)
    if gluon is None:
        import jetrl.gluon_kernels as gluon_kernels
        if not gluon_kernels.gluon_importable(): return
        gluon = gluon_kernels.launch_decode_overlapped
    torch.manual_seed(0)
    gemms = []
    for M, K, N in [(128, 18944, 3584), (256, 4864, 896)]:       # 7B and 0.5B down projections at decode
        x = kernels.quantize_1x128(bf16(M, K))
        w, w_scale, _ = weights(N, K)
        gemms.append((x, w, w_scale, torch.empty(M, N, device="cuda", dtype=torch.bfloat16), kernels.fp8_gemm_tiles(M, N, K)))
    yield ("down projections at decode (7B 128 rows + 0.5B 256 rows): overlapped vs Triton",
           us_graph(lambda: [gluon(x.data, x.scale, w.data, s, None, o) for x, w, s, o, _ in gemms]),
           us_graph(lambda: [kernels.launch_fp8_gemm(x.data, x.scale, w.data, s, None, o, t) for x, w, s, o, t in gemms]),
           1 / GLUON_DECODE_MIN_SPEEDUP)


# ---------------------------------------------------------------- the trainer's elementwise and reduction kernels
RMS_NORM_BACKWARD_MIN_SPEEDUP = 5.0          # vs autograd's recompute of torch's RMSNorm, (2048, 3584), fp32 weight
SILU_MUL_BACKWARD_MIN_SPEEDUP = 1.5          # vs torch's ops, (2048, 18944)
DY_COPIES_MIN_SPEEDUP = 1.1                  # SiLU-mul backward writing dy's FP8 copies vs it + two quantize_1x128
SILU_MUL_QUANTIZED_MIN_SPEEDUP = 1.5         # SiLU-mul writing its FP8 copy vs torch's silu * up + quantize_1x128
RMS_NORM_QUANTIZED_MIN_SPEEDUP = 1.05        # RMSNorm writing its FP8 copy vs the norm + quantize_1x128
DECODE_SILU_MUL_QUANTIZED_MIN_SPEEDUP = 1.1  # the same at decode's rows, vs the plain kernel + quantize_1x128
ROTARY_MIN_SPEEDUP = {"decode, 128 rows": 2.0, "trainer, 16 x 640": 6.0, "forward + gradient, 16 x 640": 6.0}
WEIGHT_QUANTIZER_MIN_SPEEDUP = 6.0           # quantize_128x128 vs torch's ops over an fp32 copy, 7B weights


def torch_rms_norm(x, weight, eps):
    "transformers' RMSNorm in torch's ops."
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@check("rms_norm_backward")
def rms_norm_backward():
    from jetrl.kernels import rms_norm_backward as kernel
    torch.manual_seed(0)
    M, H = 2048, 3584
    x, weight, dy = bf16(M, H), torch.rand(H, device="cuda") + 0.5, torch.randn(M, H, device="cuda")
    def autograd():
        x_, w_ = x.detach().requires_grad_(), weight.detach().requires_grad_()
        return torch.autograd.grad(torch_rms_norm(x_, w_, 1e-6), (x_, w_), dy)
    yield f"({M}, {H}) bf16, fp32 weight", us_graph(lambda: kernel(x, weight, dy, 1e-6)), us_graph(autograd), \
        1 / RMS_NORM_BACKWARD_MIN_SPEEDUP


@check("silu_mul")
def silu_mul():
    from jetrl.kernels import (quantize_1x128, silu_mul as plain, silu_mul_backward, silu_mul_backward_quantized,
                               silu_mul_quantized)
    silu = torch.nn.functional.silu
    torch.manual_seed(0)
    gate, up, d_out = bf16(2048, 18944), bf16(2048, 18944), bf16(2048, 18944)
    torch_backward = lambda: (torch.ops.aten.silu_backward(d_out * up, gate), d_out * silu(gate))
    yield "backward (2048, 18944)", us_graph(lambda: silu_mul_backward(gate, up, d_out)), us_graph(torch_backward), \
        1 / SILU_MUL_BACKWARD_MIN_SPEEDUP
    gate, up, d_out = (bf16(TRAINER_TOKENS, 18944) * 2 for _ in range(3))
    def apart():
        dg, du = silu_mul_backward(gate, up, d_out)
        return quantize_1x128(dg, "e4m3"), quantize_1x128(du, "e4m3")
    yield f"backward + dy's FP8 copies ({TRAINER_TOKENS}, 18944)", \
        us_graph(lambda: silu_mul_backward_quantized(gate, up, d_out, "e4m3")), us_graph(apart), 1 / DY_COPIES_MIN_SPEEDUP
    yield f"forward + FP8 copy ({TRAINER_TOKENS}, 18944) vs torch's ops + quantize_1x128", \
        us_graph(lambda: silu_mul_quantized(gate, up)), us_graph(lambda: quantize_1x128(silu(gate) * up)), \
        1 / SILU_MUL_QUANTIZED_MIN_SPEEDUP
    for shape in ((128, 18944), (256, 4864)):                    # decode: 7B and 0.5B
        g, u = bf16(*shape), bf16(*shape)
        yield f"forward + FP8 copy at decode {shape} vs the plain kernel + quantize_1x128", \
            us_graph(lambda: silu_mul_quantized(g, u)), us_graph(lambda: quantize_1x128(plain(g, u))), \
            1 / DECODE_SILU_MUL_QUANTIZED_MIN_SPEEDUP


@check("rms_norm_quantized")
def rms_norm_quantized():
    from jetrl.kernels import quantize_1x128, rms_norm_invariant, rms_norm_quantized as fused
    torch.manual_seed(0)
    x, weight = bf16(TRAINER_TOKENS, 3584), torch.rand(3584, device="cuda", dtype=torch.bfloat16) + 0.5
    yield f"({TRAINER_TOKENS}, 3584) vs the norm + quantize_1x128", us_graph(lambda: fused(x, weight, 1e-6)), \
        us_graph(lambda: quantize_1x128(rms_norm_invariant(x, weight, 1e-6))), 1 / RMS_NORM_QUANTIZED_MIN_SPEEDUP


def torch_rotary(x, cos, sin):
    "The rotary embedding of x (b, heads, T, d) with cos/sin (b, T, d) in torch's ops."
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]


@check("rotary")
def rotary():
    from jetrl.kernels import rotate_half_kernel
    torch.manual_seed(0)
    with use_kernel_options(KernelOptions(rotary_kernel=True)):
        for name, (b, T) in {"decode, 128 rows": (128, 1), "trainer, 16 x 640": (16, 640)}.items():
            q = bf16(b, T, 28, 128).transpose(1, 2)                  # the 7B shape's q
            angles = torch.rand(b, T, 128, device="cuda") * 1000
            cos, sin = torch.cos(angles).to(torch.bfloat16), torch.sin(angles).to(torch.bfloat16)
            yield name, us_graph(lambda: rotate_half_kernel(q, cos, sin)), us_graph(lambda: torch_rotary(q, cos, sin)), \
                1 / ROTARY_MIN_SPEEDUP[name]
        q.requires_grad_()
        dy = torch.randn_like(q)
        both = lambda f: (lambda: torch.autograd.grad(f(q, cos, sin), q, dy))
        name = "forward + gradient, 16 x 640"
        yield name, us_graph(both(rotate_half_kernel)), us_graph(both(torch_rotary)), 1 / ROTARY_MIN_SPEEDUP[name]


# ---------------------------------------------------------------- the trainer's attention backward
# Rows moved left to their first token (causal SDPA, no mask) against the masked backward it replaces: (rows, columns)
# of a 7B micro-batch at 512 new tokens and of the 4,096-token step's, ragged left padding, 32 / 8 heads of 128
ATTENTION_BACKWARD_SHAPES = ((16, 640), (2, 4650))
ATTENTION_BACKWARD_MAX_TIME_RATIO = {(16, 640): 1.0, (2, 4650): 0.5}     # measured 0.91 and 0.35 (benchmarks/README)


def trainer_attention_inputs(rows: int, T: int):
    """q, k, v (32 / 8 heads of 128, bf16, with grad), d_out, the columns, each row's first valid column (ragged left
    padding of up to a quarter of the row) and the valid columns, as the trainer's attention sees a rollout's rows."""
    q, k, v = (bf16(rows, h, T, 128).requires_grad_() for h in (32, 8, 8))
    columns = torch.arange(T, device="cuda")
    start = torch.randint(0, T // 4, (rows,), device="cuda")
    return q, k, v, bf16(rows, 32, T, 128), columns, start, columns[None] >= start[:, None]


@check("attention_backward")
def attention_backward():
    from jetrl.kernels.attention import _attention_grads
    torch.manual_seed(0)
    for rows, T in ATTENTION_BACKWARD_SHAPES:
        q, k, v, d_out, columns, _, valid = trainer_attention_inputs(rows, T)
        grads = lambda one_run: (lambda: _attention_grads(q, k, v, columns, valid, 128 ** -0.5, d_out, one_run))
        yield f"{rows} x {T}, 32 / 8 heads of 128, bf16", us_graph(grads(True)), us_graph(grads(False)), \
            ATTENTION_BACKWARD_MAX_TIME_RATIO[rows, T]


# ---------------------------------------------------------------- a BF16 trainer's attention
# A trainer that need not match the engine (BF16) moves its rows left and attends without a mask (plain causal SDPA)
# where it ran the engine's query-invariant kernel forward and the masked SDPA backward; shapes as above
BF16_TRAINER_ATTENTION_MAX_TIME_RATIO = {"forward": 0.5, "forward + backward": 0.8}


@check("bf16_trainer_attention")
def bf16_trainer_attention():
    from jetrl.kernels.attention import attend
    torch.manual_seed(0)
    for rows, T in ATTENTION_BACKWARD_SHAPES:
        q, k, v, d_out, columns, start, valid = trainer_attention_inputs(rows, T)    # the rows as the engine holds them
        moved_valid = columns[None] < (T - start)[:, None]                         # the same rows moved left
        scale = 128 ** -0.5
        plain = lambda: attend(q, k, v, columns, moved_valid, scale, plain_causal=True)
        engines = lambda: attend(q, k, v, columns, valid, scale, True, start.int(), one_run=True)
        grads = lambda f: (lambda: torch.autograd.grad(f(), (q, k, v), d_out))
        for what, timed in (("forward", lambda f: f), ("forward + backward", grads)):
            yield f"{rows} x {T}, 32 / 8 heads of 128, {what}", us_graph(timed(plain)), us_graph(timed(engines)), \
                BF16_TRAINER_ATTENTION_MAX_TIME_RATIO[what]


# ---------------------------------------------------------------- the head: log-probs and entropy at a trainer chunk
SELECTIVE_SHAPE = (4096, 151936)             # one chunk of the trainer's head by Qwen2's vocabulary
SELECTIVE_MIN_SPEEDUP = 2.0                  # selective_log_softmax forward + backward vs torch's ops
ENTROPY_MIN_SPEEDUP = 7.0                    # softmax_entropy vs torch's fp32 formula


@check("head_log_probs")
def head_log_probs():
    from benchmarks.head_logprobs import torch_selective_log_softmax
    from jetrl.kernels import selective_log_softmax
    g = torch.Generator(device="cuda").manual_seed(0)
    n, V = SELECTIVE_SHAPE
    logits = (torch.randn(n, V, device="cuda", generator=g) * 4).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (n,), device="cuda", generator=g)
    grad = torch.randn(n, device="cuda", generator=g)
    for T in (1.0, 0.7):
        both = lambda f: (lambda: torch.autograd.grad(f(logits, targets, T), logits, grad))
        yield f"{SELECTIVE_SHAPE} bf16, T = {T}, forward + backward", us_graph(both(selective_log_softmax)), \
            us_graph(both(torch_selective_log_softmax)), 1 / SELECTIVE_MIN_SPEEDUP


@check("entropy")
def entropy():
    from jetrl.kernels import entropy_from_log_softmax, softmax_entropy, temperature_log_softmax
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(*SELECTIVE_SHAPE, device="cuda", generator=g) * 4).to(torch.bfloat16)
    with use_kernel_options(KernelOptions(fused_entropy=True)):
        for T in (1.0, 0.7):
            yield f"{SELECTIVE_SHAPE} bf16, T = {T}", us_graph(lambda: softmax_entropy(logits, T)), \
                us_graph(lambda: entropy_from_log_softmax(temperature_log_softmax(logits, T))), 1 / ENTROPY_MIN_SPEEDUP


@check("weight_quantizer")
def weight_quantizer():
    from jetrl.kernels import quantize_128x128
    torch.manual_seed(0)
    for shape in ((37888, 3584), (3584, 18944)):                # 7B gate+up and down
        w = (torch.randn(shape, device="cuda") * torch.logspace(-3, 2, shape[1], device="cuda")).to(torch.bfloat16)
        for fmt in ("e4m3", "e5m2"):
            out = quantize_128x128(w, fmt)
            yield f"{shape} bf16 -> {fmt}", us_graph(lambda: quantize_128x128(w, fmt, out=out)), \
                us_graph(lambda: quantize_unchecked(w, (128, 128), fmt)), 1 / WEIGHT_QUANTIZER_MIN_SPEEDUP


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks speed_check", description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="comma-separated checks (default all): " + ", ".join(CHECKS))
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(CHECKS)); return 0
    names = [n for n in args.only.split(",") if n] or list(CHECKS)
    unknown = sorted(set(names) - set(CHECKS))
    if unknown: p.error(f"unknown check(s) {unknown}: choose from {', '.join(CHECKS)}")
    need_cuda("speed_check")
    failed = []
    with use_kernel_options(args.kernels):
        for name in names:
            for case, kernel_ms, reference_ms, bound, *timing in CHECKS[name]():
                ratio = kernel_ms / reference_ms
                row = dict(check=name, case=case, kernel_ms=kernel_ms, reference_ms=reference_ms, time_ratio=ratio,
                           max_time_ratio=round(bound, 6), passed=ratio <= bound, timing=(timing or ["graphs"])[0])
                emit(make_row("speed_check", row, argv), args.out, echo=False)
                print(f"{'ok  ' if row['passed'] else 'FAIL'} {name}: {case}: {1e3 * kernel_ms:.1f} us vs "
                      f"{1e3 * reference_ms:.1f} us ({ratio:.2f}, bound {bound:.2f})", flush=True)
                if not row["passed"]: failed.append(f"{name}: {case}")
                torch.cuda.empty_cache()
    if failed:
        print(f"{len(failed)} speed bound(s) failed:\n  " + "\n  ".join(failed))
        return 1
    print("every speed bound holds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
