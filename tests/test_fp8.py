"""Property tests and bad inputs for `jetrl.fp8`: the quantizer against references written here with explicit
loops over blocks, round-trip error bounds derived from the formats, and every error a user can hit."""
import itertools, math
import pytest
import torch
from jetrl.fp8 import (FP8_DTYPES, FP8Tensor, quantize, quantize_unchecked, resolve_block, scale_shape, compute_scale,
                       fp8_max, fp8_mm, kernel_layout, sqnr)

FMTS = ["e4m3", "e5m2"]
F32 = torch.finfo(torch.float32)
SHAPE = (130, 257)                                       # partial blocks along both dimensions for every block below
BLOCKS_2D = [(1, 128), (128, 128), (-1, 1), (7, 33), None, (1, -1), (256, 300)]


# ---- references, written independently of jetrl: loops over blocks --------------------------------------------------

def ref_block(shape, block):
    "Block sizes with -1/None resolved to the whole dimension."
    return tuple(shape) if block is None else tuple(d if b == -1 else b for d, b in zip(shape, block))

def block_slices(shape, block):
    "Every block of `shape` as (index into the scale grid, tuple of slices into the tensor)."
    block = ref_block(shape, block)
    grid = [math.ceil(d / b) for d, b in zip(shape, block)]
    for idx in itertools.product(*map(range, grid)):
        yield idx, tuple(slice(i * b, (i + 1) * b) for i, b in zip(idx, block))

def ref_scales(x, block, fmt):
    "One fp32 scale per block: amax / fp8_max, or 1 for an all-zero block."
    fmax = torch.finfo(FP8_DTYPES[fmt]).max
    block = ref_block(x.shape, block)
    out = torch.empty([math.ceil(d / b) for d, b in zip(x.shape, block)])
    for idx, sl in block_slices(x.shape, block):
        amax = x[sl].float().abs().max()
        out[idx] = amax / fmax if amax > 0 else 1.0
    return out

def per_element_scale(shape, block, scale):
    "The scale of each element's block, broadcast to `shape`."
    out = torch.empty(shape)
    for idx, sl in block_slices(shape, block): out[sl] = scale[idx]
    return out

def ref_dequantize(q: FP8Tensor):
    out = torch.empty(q.shape)
    for idx, sl in block_slices(q.shape, q.block): out[sl] = q.data[sl].float() * q.scale[idx]
    return out

def wide_range(shape, seed=0, dtype=torch.float32):
    "Values over ~10 decades, plus 2% scaled by 1e-12, so that many fall in the subnormal range of their block."
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(3 * torch.randn(shape, generator=g))
    return torch.where(torch.rand(shape, generator=g) < 0.02, x * 1e-12, x).to(dtype)


# ---- the round-trip bound ---------------------------------------------------------------------------------------------
# With s the block's scale, q = fl32(x / s) (relative error <= 2^-24), f = the FP8 rounding of q, dq = fl32(f * s).
# * If |q| >= tiny (the smallest normal FP8 number), round-to-nearest moves q by at most half an ulp of its binade,
#   ulp/2 = 2^(e - m - 1) <= |q| 2^-(m+1) (m mantissa bits: finfo.eps = 2^-m), so, with the two fp32 roundings,
#       |x - dq| <= |x| (2^-(m+1) + 2^-22)          (2^-22 > 3 * 2^-24 covers the two fp32 roundings).
#   2^-(m+1) is 2^-4 for E4M3 and 2^-3 for E5M2.
# * Below tiny the grid is uniform with the subnormal step: |f - q| <= smallest_subnormal / 2, so
#       |x - dq| <= s * smallest_subnormal / 2 + |x| 2^-22.
# The sum of both bounds holds everywhere; we add fp32's smallest subnormal for f * s that underflows fp32.

def subnormal_step(fi: torch.finfo) -> float:
    "The spacing of the subnormals (torch.finfo has no smallest_subnormal): tiny * eps."
    return fi.tiny * fi.eps

def roundtrip_bound(x32, s, fmt):
    fi = torch.finfo(FP8_DTYPES[fmt])
    return x32.abs() * (fi.eps / 2 + 2**-22) + s * subnormal_step(fi) / 2 + subnormal_step(F32)

def test_format_constants():
    "The bound's constants, from torch.finfo, are the ones the formats are known for."
    e4m3, e5m2 = torch.finfo(torch.float8_e4m3fn), torch.finfo(torch.float8_e5m2)
    assert (e4m3.eps / 2, e5m2.eps / 2) == (2**-4, 2**-3)
    assert (fp8_max("e4m3"), fp8_max("e5m2")) == (448.0, 57344.0)
    assert (e4m3.tiny, e5m2.tiny, subnormal_step(e4m3), subnormal_step(e5m2)) == (2**-6, 2**-14, 2**-9, 2**-16)
    assert subnormal_step(F32) == 2**-149

@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("block", [(1, 128), (128, 128), (-1, 1), (7, 33), None])
def test_roundtrip_error_bound(fmt, pow2, block):
    x = wide_range(SHAPE, seed=1)
    q = quantize(x, block, fmt, pow2)
    dq = q.dequantize()
    s = per_element_scale(x.shape, q.block, q.scale)
    fi = torch.finfo(FP8_DTYPES[fmt])
    err = (x - dq).abs()
    normal = x.abs() / s >= fi.tiny
    assert normal.sum() > 1000 and (~normal).sum() > 100, "the data must exercise both regimes"
    # normal range: the relative bound alone
    assert (err[normal] <= x.abs()[normal] * (fi.eps / 2 + 2**-22)).all()
    # the bound is nearly tight: the worst relative error, a midpoint just above a power of two, is
    # u / (1 + u) with u = 2^-(m+1) (1/17 for E4M3, 1/9 for E5M2); random data gets within 10% of it
    u = fi.eps / 2
    assert (err[normal] / x.abs()[normal]).max() > 0.9 * u / (1 + u)
    # everywhere: relative + half the subnormal step times the scale
    assert (err <= roundtrip_bound(x, s, fmt)).all()

@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("block", BLOCKS_2D)
def test_scales_and_dequantize_match_loops(fmt, block):
    x = wide_range(SHAPE, seed=2)
    q = quantize(x, block, fmt)
    assert q.block == ref_block(x.shape, block) and q.fmt == fmt and q.data.dtype == FP8_DTYPES[fmt]
    assert q.data.shape == x.shape and q.scale.dtype == torch.float32
    assert tuple(q.scale.shape) == scale_shape(x.shape, q.block)
    assert torch.equal(q.scale, ref_scales(x, block, fmt))      # the same fp32 division: bit-identical
    assert torch.equal(q.dequantize(), ref_dequantize(q))

@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("block", BLOCKS_2D)
def test_block_amax_maps_onto_fp8_max(fmt, block):
    x = wide_range(SHAPE, seed=3)
    q = quantize(x, block, fmt)
    fmax = fp8_max(fmt)
    for idx, sl in block_slices(x.shape, block):
        block_data = q.data[sl].float()
        assert block_data.abs().max() == fmax
        # and it is the element holding the block's amax that lands there
        assert block_data.flatten()[x[sl].abs().argmax()].abs() == fmax

@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("block", BLOCKS_2D)
def test_pow2_scales(fmt, block):
    x = wide_range(SHAPE, seed=4)
    q = quantize(x, block, fmt, pow2_scale=True)
    exact = ref_scales(x, block, fmt)                           # amax / max, in fp32
    assert (torch.frexp(q.scale).mantissa == 0.5).all(), "every scale is a power of two"
    assert (q.scale >= exact).all(), "rounded up, never down: no value can exceed fp8_max"
    assert (q.scale < 2 * exact).all(), "the smallest such power of two"
    data = q.data.float()
    assert torch.isfinite(data).all() and data.abs().max() <= fp8_max(fmt)

@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("k", [-20, 0, 5])
def test_pow2_scale_exact_power(fmt, k):
    "amax = fp8_max * 2^k exactly: the scale is 2^k (not 2^(k+1)) and amax lands on fp8_max."
    x = torch.tensor([[fp8_max(fmt) * 2.0**k, 1.0 * 2.0**k, -0.5 * 2.0**k]])
    q = quantize(x, None, fmt, pow2_scale=True)
    assert q.scale.item() == 2.0**k and q.data.float().abs().max() == fp8_max(fmt)
    assert torch.equal(q.dequantize(), x)                      # all three values are representable

@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("pow2", [False, True])
def test_values_near_fp32_max_stay_finite(fmt, pow2):
    "Finite inputs near fp32's max: scales, FP8 data and the dequantized values are all finite and within the bound."
    x = torch.tensor([[F32.max, -F32.max / 3, 1.0], [F32.max * (1 - 2**-10), 1e30, -1.0]])
    if pow2:
        # 2^120 * 256 = 2^128 overflows fp32: quantize refuses such inputs with power-of-two scales, saying why
        with pytest.raises(ValueError, match="2\\^127"):
            quantize(x, (1, -1), fmt, pow2)
        x = x / 4                                              # just under the limit: finite and within the bound
    q = quantize(x, (1, -1), fmt, pow2)
    assert torch.isfinite(q.scale).all() and torch.isfinite(q.data.float()).all()
    s = per_element_scale(x.shape, q.block, q.scale)
    dq = q.dequantize()
    assert torch.isfinite(dq).all(), f"finite input {x[~torch.isfinite(dq)].tolist()} dequantized to {dq[~torch.isfinite(dq)].tolist()}"
    assert ((x - dq).abs() <= roundtrip_bound(x, s, fmt)).all()


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("pow2", [False, True])
def test_zero_blocks(fmt, pow2):
    x = wide_range(SHAPE, seed=5)
    x[:3] = 0                                                   # three zero rows: zero blocks under (1, 128)
    x[:, 128:256] = 0                                           # a zero column band: zero blocks under (128, 128)
    for block in [(1, 128), (128, 128)]:
        q = quantize(x, block, fmt, pow2)
        zero_blocks = ref_scales(x, block, fmt) == 1.0
        assert zero_blocks.sum() >= 2
        assert (q.scale[zero_blocks] == 1.0).all() and torch.isfinite(q.scale).all()
        dq = q.dequantize()
        assert (dq[x == 0] == 0).all() and torch.isfinite(dq).all()
    q = quantize(torch.zeros(4, 5), None, fmt, pow2)            # an all-zero tensor
    assert q.scale.item() == 1.0 and torch.equal(q.dequantize(), torch.zeros(4, 5))

def test_compute_scale_edge_cases():
    amax = torch.tensor([0.0, 448.0, 1e-45, 3.0])
    s = compute_scale(amax, "e4m3")
    assert s[0] == 1.0 and s[1] == 1.0 and s[2] == F32.tiny and s[3] == torch.tensor(3.0) / 448
    s2 = compute_scale(amax, "e4m3", pow2_scale=True)
    assert s2.tolist() == [1.0, 1.0, F32.tiny, 2.0**-7]        # 3/448 = 2^-7.22 -> 2^-7

def test_tiny_values():
    "Blocks whose amax/max underflows fp32 get the smallest normal fp32 scale; the bound still holds."
    x = torch.tensor([[1e-44, 0.0, -3e-45], [1e-40, 2e-40, 0.0], [1e-30, 1e-38, 1.0]])
    for fmt, pow2 in itertools.product(FMTS, (False, True)):
        q = quantize(x, (1, -1), fmt, pow2)
        assert (q.scale > 0).all() and torch.isfinite(q.scale).all()
        s = per_element_scale(x.shape, q.block, q.scale)
        assert ((x - q.dequantize()).abs() <= roundtrip_bound(x, s, fmt)).all()

@pytest.mark.parametrize("block", [(2, 16, 32), (1, 1, -1), (-1, 7, 5), None, (3, 64, 128)])
@pytest.mark.parametrize("pow2", [False, True])
def test_3d(block, pow2):
    x = wide_range((3, 50, 70), seed=6)
    q = quantize(x, block, "e4m3", pow2)
    assert q.block == ref_block(x.shape, block) and q.scale.dim() == 3
    if not pow2: assert torch.equal(q.scale, ref_scales(x, block, "e4m3"))
    assert torch.equal(q.dequantize(), ref_dequantize(q))
    s = per_element_scale(x.shape, q.block, q.scale)
    assert ((x - q.dequantize()).abs() <= roundtrip_bound(x, s, "e4m3")).all()

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FMTS)
def test_half_precision_inputs(dtype, fmt):
    x = (torch.randn(SHAPE, generator=torch.Generator().manual_seed(7)) * 100).to(dtype)
    q = quantize(x, (1, 128), fmt)
    x32 = x.float()                                             # the bound is against the values actually given
    assert torch.equal(q.scale, ref_scales(x32, (1, 128), fmt))
    s = per_element_scale(x.shape, q.block, q.scale)
    assert ((x32 - q.dequantize()).abs() <= roundtrip_bound(x32, s, fmt)).all()
    assert q.dequantize(dtype).dtype == dtype and torch.equal(q.dequantize(dtype), q.dequantize().to(dtype))
    assert sqnr(x32, q.dequantize()) > (25 if fmt == "e4m3" else 19)

def test_fp16_values_beyond_e4m3_range():
    "fp16 reaches 65504, above both FP8 maxima: scaling brings it in range, nothing saturates to NaN/Inf."
    x = torch.tensor([[65504.0, -60000.0, 1.0, 0.5]], dtype=torch.float16)
    for fmt in FMTS:
        q = quantize(x, None, fmt)
        assert torch.isfinite(q.data.float()).all() and q.data.float().abs().max() == fp8_max(fmt)
        assert abs(q.dequantize()[0, 0].item() - 65504.0) <= 65504.0 * 2**-22

@pytest.mark.parametrize("shape, block, scales", [
    ((0, 5), (1, 128), (0, 1)), ((5, 0), (1, 128), (5, 0)), ((0, 5), None, (0, 1)),
    ((1, 1), (128, 128), (1, 1)), ((4,), (2,), (2,)), ((), None, ())])
def test_empty_and_tiny_shapes(shape, block, scales):
    x = torch.randn(shape)
    q = quantize(x, block, "e4m3")
    assert tuple(q.scale.shape) == scales and q.shape == x.shape
    dq = q.dequantize()
    assert dq.shape == x.shape
    if x.numel(): assert ((x - dq).abs() <= x.abs() * 2**-4 * (1 + 2**-18)).all()

def test_constant_block_is_exact():
    x = torch.full((3, 8), -2.5)
    q = quantize(x, (1, 8), "e4m3")
    assert (q.data.float() == -448).all() and torch.equal(q.dequantize(), x)

@pytest.mark.parametrize("block", [(128, 128), (32, 32), (7, 7), None, (-1, -1)])
def test_transpose_square_blocks(block):
    x = wide_range((130, 257), seed=8)
    qt, q_of_t = quantize(x, block, "e4m3").t(), quantize(x.t(), block, "e4m3")
    assert qt.shape == x.t().shape and qt.block == q_of_t.block
    assert torch.equal(qt.data.view(torch.uint8), q_of_t.data.view(torch.uint8))
    assert torch.equal(qt.scale, q_of_t.scale)
    assert torch.equal(qt.dequantize(), quantize(x, block, "e4m3").dequantize().t())

@pytest.mark.parametrize("block", [(1, 128), (1, -1), (7, 33)])
def test_transpose_non_square_blocks(block):
    "A non-square block transposes too: t() equals quantizing the transpose with the transposed block."
    x = wide_range((130, 257), seed=9)
    qt = quantize(x, block, "e4m3").t()
    q_of_t = quantize(x.t(), ref_block(x.shape, block)[::-1], "e4m3")
    assert torch.equal(qt.data.view(torch.uint8), q_of_t.data.view(torch.uint8)) and torch.equal(qt.scale, q_of_t.scale)

def test_resolve_block_and_scale_shape():
    assert resolve_block((130, 257), None) == (130, 257)
    assert resolve_block((130, 257), (1, -1)) == (1, 257)
    assert resolve_block((0, 5), (-1, 2)) == (1, 2)              # an empty dimension still gets a positive block
    assert resolve_block((10,), 4) == (4,)
    assert scale_shape((130, 257), (128, 128)) == (2, 3) and scale_shape((130, 257), (7, 33)) == (19, 8)

def test_quantize_unchecked_equals_quantize():
    x = wide_range(SHAPE, seed=10)
    a, b = quantize(x, (1, 128), "e5m2", True), quantize_unchecked(x, (1, 128), "e5m2", True)
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)

def test_nbytes():
    q = quantize(torch.randn(130, 257), (1, 128), "e4m3")
    assert q.nbytes == 130 * 257 + 130 * 3 * 4


# ---- fp8_mm, kernel_layout, sqnr ------------------------------------------------------------------------------------

def test_fp8_mm_emulated_is_the_product_of_the_dequantized_operands():
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(130, 257, generator=g), torch.randn(257, 70, generator=g)
    a, b = quantize(x, (1, 128), "e4m3"), quantize(w, (128, 128), "e4m3")
    out = fp8_mm(a, b, backend="emulated")
    ref = a.dequantize().double() @ b.dequantize().double()
    # fp32 accumulation over K = 257 terms: error ~ sqrt(K) 2^-24 |terms|, far below 1e-5 of the largest entry
    assert out.dtype == torch.float32 and torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
    assert torch.equal(fp8_mm(a, b), out)                         # 'auto' on CPU is the emulation
    assert fp8_mm(a, b, out_dtype=torch.bfloat16).dtype == torch.bfloat16
    assert sqnr(x @ w, out) > 25                                  # two E4M3 operands: ~26 dB

def test_kernel_layout_names():
    x, w = torch.randn(256, 384), torch.randn(384, 256)
    q = lambda t, blk: quantize(t, blk, "e4m3")
    assert kernel_layout(q(x, None), q(w, None)) == "tensorwise"
    assert kernel_layout(q(x, (1, -1)), q(w, (-1, 1))) == "rowwise"
    assert kernel_layout(q(x, (1, 128)), q(w, (128, 128))) == "blockwise_1x128_128x128"
    assert kernel_layout(q(x, (1, 128)), q(w, (128, 1))) == "blockwise_1x128_1x128"
    assert kernel_layout(q(x, (7, 33)), q(w, (128, 128))) is None

def test_sqnr():
    x = torch.randn(1000)
    assert sqnr(x, x) == float("inf")
    # noise = 0.1 |x|: 20 log10(10); 1e-5 dB allows for 0.9 * x rounded to fp32
    assert sqnr(x, 0.9 * x) == pytest.approx(20.0, abs=1e-5)
    assert sqnr(x, 0.99 * x) == pytest.approx(40.0, abs=1e-3)


# ---- bad inputs: the right exception type and a message naming the problem ----------------------------------------

def test_nan_inf_counted():
    x = torch.randn(10, 20)
    x[1, 2] = x[3, 4] = float("nan"); x[5, 6] = float("inf"); x[7, 8] = -float("inf")
    with pytest.raises(ValueError, match=r"4 non-finite value\(s\) \(2 NaN, 2 Inf\) of 200, first at index \[\[1, 2\]"):
        quantize(x, (1, 128))

def test_nan_in_bf16():
    x = torch.ones(4, 4, dtype=torch.bfloat16); x[2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"1 non-finite value\(s\) \(1 NaN, 0 Inf\)"):
        quantize(x, None)

def test_meta_tensor_is_refused_with_what_to_do():
    "A meta tensor has a shape and no values: one ValueError that says so, not torch's error from reading a value."
    with pytest.raises(ValueError, match="meta device.*load the weights first"):
        quantize(torch.empty(4, 128, device="meta"), (1, 128))

@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_int_dtype(dtype):
    with pytest.raises(TypeError, match=f"dtype {dtype}.*floating-point"):
        quantize(torch.ones(4, 4, dtype=dtype), None)

@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_already_fp8(dtype):
    with pytest.raises(TypeError, match="already FP8"):
        quantize(torch.ones(4, 4).to(dtype), None)

def test_not_a_tensor():
    with pytest.raises(TypeError, match="must be a torch.Tensor, got list"):
        quantize([[1.0, 2.0]], None)

@pytest.mark.parametrize("shape, block", [((4, 4), (128,)), ((4, 4), (1, 1, 128)), ((2, 3, 4), (1, 128))])
def test_rank_mismatch(shape, block):
    with pytest.raises(ValueError, match=rf"has {len(block)} dimension\(s\) but the tensor has shape"):
        quantize(torch.randn(shape), block)

@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "128"])
def test_bad_block_sizes(bad):
    with pytest.raises(ValueError, match="each size must be a positive int or -1"):
        quantize(torch.randn(4, 4), (1, bad))

@pytest.mark.parametrize("fmt", ["e3m4", "E4M3", "fp8", "e4m3fnuz"])
def test_unknown_format(fmt):
    with pytest.raises(ValueError, match=f"Unknown FP8 format '{fmt}'"):
        quantize(torch.randn(4, 4), None, fmt)
    with pytest.raises(ValueError, match="Unknown FP8 format"):
        fp8_max(fmt)

def test_fp8_mm_shape_mismatch():
    a, b = quantize(torch.randn(4, 8), None), quantize(torch.randn(9, 3), None)
    with pytest.raises(ValueError, match=r"\(M, K\) by \(K, N\): got \(4, 8\) and \(9, 3\)"):
        fp8_mm(a, b)
    c = quantize(torch.randn(2, 4, 8), None)
    with pytest.raises(ValueError, match=r"got \(2, 4, 8\) and \(8, 3\)"):
        fp8_mm(c, quantize(torch.randn(8, 3), None))

def test_fp8_mm_kernel_backend_on_cpu():
    a, b = quantize(torch.randn(16, 32), None), quantize(torch.randn(32, 16), None)
    with pytest.raises(RuntimeError, match="No FP8 kernel .* on cpu"):
        fp8_mm(a, b, backend="kernel")

def test_fp8_mm_unknown_backend():
    a, b = quantize(torch.randn(16, 32), None), quantize(torch.randn(32, 16), None)
    with pytest.raises(ValueError, match="backend must be 'auto', 'kernel' or 'emulated', got 'cuda'"):
        fp8_mm(a, b, backend="cuda")


def test_gemm_scales_column_major_with_at_most_one_copy():
    """The 1x128 scales as cuBLAS's blockwise GEMM reads them, (rows, K/128) with the rows contiguous: scales already so
    and of the padded shape pass as they are; row-major ones, or ones that need padding (rows to a multiple of 16, K to
    128), are copied once, padded with ones (the scale of the zero padding)."""
    from jetrl.fp8 import _pad_scale, _pad_scale_column_major
    column_major = torch.rand(3, 32).t()                                 # (32 rows, 3 groups), strides (1, 32)
    assert _pad_scale_column_major(column_major, 32, 3).data_ptr() == column_major.data_ptr()
    for scale, rows, cols in [(column_major.contiguous(), 32, 3), (column_major[:30], 32, 3), (column_major, 48, 4),
                              (column_major.contiguous()[:30], 32, 3)]:
        laid_out = _pad_scale_column_major(scale, rows, cols)
        assert laid_out.shape == (rows, cols) and laid_out.stride() == (1, rows)
        assert torch.equal(laid_out, _pad_scale(scale, rows, cols))
        assert laid_out.data_ptr() != scale.data_ptr()
