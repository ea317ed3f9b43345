"""Tests of `jetrl.kernels.grad`: the requantizer gives the CPU quantizer's bytes and scales (partial groups, zero
rows, E4M3 and E5M2, bf16 / fp16 / fp32 inputs), and FP8LinearFunction's backward through it equals torch's passes'
dx and dW bit for bit. The kernels run where Triton runs: on a CUDA GPU, or on the CPU under Triton's interpreter

    TRITON_INTERPRET=1 python -m pytest -q tests/test_grad_kernels.py        (Triton installed; ~3 minutes)

Elsewhere (CI: no Triton) those tests are skipped and only the input checks and errors run."""
import pytest
import torch

import jetrl.kernels.grad
import jetrl.linear
from jetrl.fp8 import FP8Tensor, KERNEL_BLOCK, quantize_unchecked
from jetrl.kernels import HAS_TRITON, INTERPRETING, invariant_kernels_available
from jetrl.kernels.grad import (HP_DTYPES, REQUANTIZE_CANDIDATES, requantize_for_wgrad, fused_grad_quantizers,
                                fused_grad_quantizers_active, _round_to_format)
from jetrl.linear import FP8Recipe, FP8LinearFunction, _quantize
from test_kernels import assert_same_fp8_but_nan_signs, assert_scales_column_major, gpu_casts  # noqa: F401 (a fixture)

G = KERNEL_BLOCK
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not invariant_kernels_available(DEVICE),
                                   reason="needs Triton: a CUDA GPU, or TRITON_INTERPRET=1 on the CPU")
RECIPE = FP8Recipe("blockwise")
# partial groups along both dimensions, exactly one group, a single row, no rows, no columns
SHAPES = [(300, 200), (128, 256), (1, 5), (0, 200), (200, 0)]


def assert_same_fp8(got: FP8Tensor, want: FP8Tensor):
    "The same codes byte for byte, the same scales, block, format and shape; the data in the layout of `want`."
    assert (got.block, got.fmt, got.data.shape, got.scale.shape) == (want.block, want.fmt, want.data.shape, want.scale.shape)
    assert torch.equal(got.data.cpu().view(torch.uint8), want.data.cpu().view(torch.uint8)), "FP8 codes differ"
    assert torch.equal(got.scale.cpu(), want.scale.cpu()), "scales differ"


def transposed_oracle(t: torch.Tensor, fmt: str) -> FP8Tensor:
    "What the backward hands Wgrad without the kernels: `_quantize(t, recipe, operand, 'wgrad', True)` on the CPU quantizer."
    return _quantize(t, FP8Recipe("oracle", act_fmt=fmt, grad_fmt=fmt), "dy", "wgrad", True)


def ragged_values(M: int, N: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    "Columns spanning six decades of magnitude (so scales differ a lot), row 1 all zeros (scale 1)."
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(M, N, generator=g) * torch.logspace(-3, 3, N)
    t[1:2] = 0
    return t.to(dtype)


# ---- the exact rounding that the kernels use under the interpreter (its own casts are wrong) ----

@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16])
def test_exact_rounding_equals_torch_cast(dtype):
    "Every code (a sample for 16-bit formats), the ties between neighbours and the floats beside them: torch's cast, bit for bit."
    bits = torch.arange(2 ** (8 * dtype.itemsize), dtype=torch.int32)
    codes = (bits.to(torch.uint8) if dtype.itemsize == 1 else bits.to(torch.int16)).view(dtype).float()
    codes = codes[torch.isfinite(codes)].unique()
    if dtype.itemsize == 2: codes = codes[torch.randperm(codes.numel(), generator=torch.Generator().manual_seed(0))[:4096]].sort().values
    ties = ((codes[1:].double() + codes[:-1].double()) / 2).float()
    x32 = torch.cat([codes, ties, torch.nextafter(ties, torch.tensor(float("inf"))), torch.nextafter(ties, torch.tensor(-float("inf"))),
                     torch.tensor([0.0, -0.0, 1e-45, -1e-45, 2.0**-126, 3 * 2.0**-134])])
    got = _round_to_format(x32.to(DEVICE), dtype).cpu()
    assert torch.equal(got.view(torch.int32), x32.to(dtype).float().view(torch.int32))


@needs_kernels
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_backward_quantizers_keep_nan_and_inf_visible(fmt, gpu_casts):
    """A group holding NaN gets scale 1 and its NaN stays NaN, a group holding inf scale inf, in Wgrad's requantized x,
    as the CPU quantizer has them (the quantizers' rule, `jetrl.kernels.support`): a diverged activation must not turn
    into finite FP8 codes. Under the interpreter the amax half is checked (its max skips a NaN
    as the GPU's does; `gpu_casts`: its own FP8 cast turns NaN into a finite code, the GPU's keeps it); on a GPU, the
    clamp too."""
    dy = ragged_values(300, 260, torch.bfloat16, seed=7) * 100
    dy[3, 7] = dy[200, 250] = float("nan"); dy[11, 130], dy[140, 5] = float("inf"), -float("inf")
    x_fp8 = quantize_unchecked(dy, (1, G), fmt)                       # a saved activation holding NaN and inf groups
    got = requantize_for_wgrad(FP8Tensor(x_fp8.data.to(DEVICE), x_fp8.scale.to(DEVICE), (1, G), fmt), torch.bfloat16)
    want = transposed_oracle(x_fp8.dequantize(torch.bfloat16), fmt)
    assert want.data.float().isnan().any() and (want.scale == 1).any()
    assert_same_fp8_but_nan_signs(got, want)


@pytest.fixture
def launch_tables():
    "REQUANTIZE_LAUNCH, restored after the test."
    table = jetrl.kernels.grad.REQUANTIZE_LAUNCH
    saved = dict(table)
    yield table
    table.clear(); table.update(saved)


@needs_kernels
@pytest.mark.parametrize("launch", REQUANTIZE_CANDIDATES, ids=lambda l: "-".join(f"{k}{v}" for k, v in l.items()))
def test_every_requantize_candidate_gives_the_same_bytes(launch, launch_tables):
    "Every requantizer launch the benchmark sweeps (tile, quads; warps, columns) gives the CPU oracle's bytes and scales."
    launch_tables.clear(); launch_tables.update(launch)
    # partial groups both ways (K = 200: a tile's columns past K; 300 tokens: a partial group of 44), a partial
    # group of K, a single row, no rows
    for M, K in [(300, 200), (129, 100), (1, 5), (0, 200)]:
        x = ragged_values(M, K, torch.bfloat16, seed=5)
        for act_fmt, hp_dtype in [("e4m3", torch.bfloat16), ("e5m2", torch.bfloat16), ("e4m3", torch.float32),
                                  ("e5m2", torch.float32)]:
            x_fp8 = quantize_unchecked(x, (1, G), act_fmt)
            want = transposed_oracle(x_fp8.dequantize(hp_dtype), act_fmt)
            got = requantize_for_wgrad(FP8Tensor(x_fp8.data.contiguous().to(DEVICE), x_fp8.scale.to(DEVICE), (1, G), act_fmt),
                                       hp_dtype)
            assert_same_fp8(got, want)
            if got.data.numel(): assert got.data.stride() == want.data.stride()           # (1, M): x.T contiguous
            assert_scales_column_major(got.t())                                          # as Wgrad's GEMM reads them
    x_fp8 = quantize_unchecked(ragged_values(260, 300, torch.bfloat16, seed=6), (1, G))    # a column-major saved copy
    data = x_fp8.data.t().contiguous().t()
    got = requantize_for_wgrad(FP8Tensor(data.to(DEVICE), x_fp8.scale.to(DEVICE), (1, G), "e4m3"), torch.bfloat16)
    assert_same_fp8(got, transposed_oracle(x_fp8.dequantize(torch.bfloat16), "e4m3"))


@needs_kernels
def test_an_unknown_launch_form_fails_clearly(launch_tables):
    x_fp8 = quantize_unchecked(torch.randn(4, 8), (1, G))
    launch_tables.update(form="rows")
    with pytest.raises(ValueError, match=r"REQUANTIZE_LAUNCH\['form'\] is one of \['quads', 'tile'\]"):
        requantize_for_wgrad(FP8Tensor(x_fp8.data.to(DEVICE), x_fp8.scale.to(DEVICE), (1, G), "e4m3"))
    for cols in (48, 0, 256):                                         # a requantizer tile's columns must divide 128
        launch_tables.clear(); launch_tables.update(form="tile", COLS=cols)
        with pytest.raises(ValueError, match=r"REQUANTIZE_LAUNCH\['COLS'\] must divide 128"):
            requantize_for_wgrad(FP8Tensor(x_fp8.data.to(DEVICE), x_fp8.scale.to(DEVICE), (1, G), "e4m3"))


@needs_kernels
def test_quads_kernel_runs_on_whole_words_and_the_tile_kernel_otherwise(monkeypatch):
    "The default launch does run the quads kernel where the tokens are a multiple of 4 (the tests above then check its bytes)."
    ran, real = [], jetrl.kernels.grad._kernel
    def spy(kernels, launch, table):
        kernel, rest = real(kernels, launch, table)
        ran.append(next(form for form, k in kernels.items() if k is kernel))
        return kernel, rest
    monkeypatch.setattr(jetrl.kernels.grad, "_kernel", spy)
    for M, form in [(300, "quads"), (129, "tile")]:
        ran.clear()
        x_fp8 = quantize_unchecked(ragged_values(M, 200, torch.bfloat16), (1, G))
        requantize_for_wgrad(FP8Tensor(x_fp8.data.to(DEVICE), x_fp8.scale.to(DEVICE), (1, G), "e4m3"))
        assert ran == [form], (M, ran)


def test_quads_launches_only_where_the_tokens_fill_whole_words():
    "The quads form packs four tokens to a word: other token counts take the tile form (the bytes are the same)."
    from jetrl.kernels.grad import _aligned, REQUANTIZE_LAUNCH, REQUANTIZE_UNALIGNED
    assert REQUANTIZE_LAUNCH["form"] == "quads"                                     # the default, as measured
    for tokens in (4, 300, 10240):
        assert _aligned(REQUANTIZE_LAUNCH, REQUANTIZE_UNALIGNED, tokens) is REQUANTIZE_LAUNCH
    for tokens in (1, 129, 10241):
        assert _aligned(REQUANTIZE_LAUNCH, REQUANTIZE_UNALIGNED, tokens) is REQUANTIZE_UNALIGNED
    assert REQUANTIZE_UNALIGNED["form"] == "tile"
    tile = dict(form="tile", num_warps=8)
    assert _aligned(tile, REQUANTIZE_UNALIGNED, 129) is tile                         # a tile launch runs as it is


# ---- x: Wgrad's operand from the saved FP8 copy ----

@needs_kernels
@pytest.mark.parametrize("M, K", SHAPES)
@pytest.mark.parametrize("act_fmt, hp_dtype", [("e4m3", torch.bfloat16), ("e5m2", torch.bfloat16), ("e4m3", torch.float32),
                                               ("e4m3", torch.float16)])
def test_requantize_equals_dequantize_then_quantize(M, K, act_fmt, hp_dtype):
    x_fp8 = quantize_unchecked(ragged_values(M, K, torch.bfloat16, seed=1), (1, G), act_fmt)
    x_fp8 = FP8Tensor(x_fp8.data.contiguous().to(DEVICE), x_fp8.scale.to(DEVICE), x_fp8.block, act_fmt)
    got = requantize_for_wgrad(x_fp8, hp_dtype)
    want = transposed_oracle(FP8Tensor(x_fp8.data.cpu(), x_fp8.scale.cpu(), (1, G), act_fmt).dequantize(hp_dtype), act_fmt)
    assert_same_fp8(got, want)
    if got.data.numel(): assert got.data.stride() == want.data.stride()


@needs_kernels
def test_requantize_rounds_to_the_backward_dtype_first():
    "The rounding to bf16 changes scales and codes: a kernel that skipped it would fail the test above, and this one."
    x_fp8 = quantize_unchecked(ragged_values(300, 256, torch.bfloat16, seed=2), (1, G))
    rounded, unrounded = (transposed_oracle(x_fp8.dequantize(dtype), "e4m3") for dtype in (torch.bfloat16, torch.float32))
    assert (rounded.scale != unrounded.scale).float().mean() > 0.3                          # measured: ~70%
    on_device = FP8Tensor(x_fp8.data.contiguous().to(DEVICE), x_fp8.scale.to(DEVICE), (1, G), "e4m3")
    assert_same_fp8(requantize_for_wgrad(on_device, torch.bfloat16), rounded)
    assert_same_fp8(requantize_for_wgrad(on_device, torch.float32), unrounded)


@needs_kernels
def test_requantize_output_format():
    "fmt= picks the output's format independently of the saved copy's."
    x_fp8 = quantize_unchecked(ragged_values(200, 130, torch.bfloat16), (1, G), "e4m3")
    got = requantize_for_wgrad(FP8Tensor(x_fp8.data.to(DEVICE), x_fp8.scale.to(DEVICE), (1, G), "e4m3"), torch.bfloat16, "e5m2")
    assert_same_fp8(got, transposed_oracle(x_fp8.dequantize(torch.bfloat16), "e5m2"))


# ---- the whole backward: the kernels against torch's passes ----

def run_backward(x, w, dy, recipe, bias=None, grads=(True, True)):
    "dx, dW (and db) of FP8LinearFunction for the given inputs."
    xi, wi = x.clone().requires_grad_(grads[0]), w.clone().requires_grad_(grads[1])
    bi = None if bias is None else bias.clone().requires_grad_()
    FP8LinearFunction.apply(xi, wi, bi, recipe).backward(dy)
    return [None if t is None else t.grad for t in (xi, wi, bi)]


@pytest.fixture
def kernel_calls(monkeypatch):
    "Counts the backward's calls of the requantizer."
    calls = {"requantize": 0}
    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(jetrl.linear, "requantize_for_wgrad", counting("requantize", requantize_for_wgrad))
    return calls


@needs_kernels
@pytest.mark.parametrize("recipe", [FP8Recipe("blockwise"), FP8Recipe("e5m2-grads", grad_fmt="e5m2"),
                                    FP8Recipe("e5m2-acts", act_fmt="e5m2")], ids=lambda r: r.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_backward_equals_torchs_passes_bitwise(recipe, dtype, kernel_calls):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 150, 200, generator=g).to(dtype).to(DEVICE)              # 300 tokens, K = 200: partial groups
    w = (torch.randn(136, 200, generator=g) / 200**0.5).to(dtype).to(DEVICE)
    dy, bias = torch.randn(2, 150, 136, generator=g).to(dtype).to(DEVICE), torch.randn(136).to(dtype).to(DEVICE)
    with fused_grad_quantizers(False): old = run_backward(x, w, dy, recipe, bias)
    assert kernel_calls == {"requantize": 0}
    with fused_grad_quantizers(True): new = run_backward(x, w, dy, recipe, bias)
    assert kernel_calls == {"requantize": 1}                                    # the kernel did run
    for name, a, b in zip(("dx", "dW", "db"), old, new):
        assert torch.equal(a, b), f"{recipe.name} {dtype}: {name} differs"


@needs_kernels
@pytest.mark.parametrize("grads", [(False, True), (True, False)], ids=["weight-only", "input-only"])
def test_fused_backward_with_one_gradient(grads, kernel_calls):
    "Only dW (a first layer) or only dx (a frozen weight): the requantizer only for dW; the same bits."
    g = torch.Generator().manual_seed(1)
    x, w, dy = torch.randn(260, 384, generator=g), torch.randn(200, 384, generator=g) / 20, torch.randn(260, 200, generator=g)
    x, w, dy = (t.to(torch.bfloat16).to(DEVICE) for t in (x, w, dy))
    with fused_grad_quantizers(False): old = run_backward(x, w, dy, RECIPE, grads=grads)
    with fused_grad_quantizers(True): new = run_backward(x, w, dy, RECIPE, grads=grads)
    assert kernel_calls == {"requantize": int(grads[1])}
    for a, b in zip(old, new):
        assert (a is None and b is None) or torch.equal(a, b)


@needs_kernels
@pytest.mark.parametrize("recipe", [FP8Recipe("pow2", pow2_scale=True), FP8Recipe("rowwise", "rowwise"),
                                    FP8Recipe("tensorwise", "tensorwise"), FP8Recipe("g64", group_size=64),
                                    FP8Recipe("fprop-bf16", fp8_gemms=("dgrad", "wgrad"))], ids=lambda r: r.name)
def test_other_recipes_keep_torchs_passes(recipe, kernel_calls):
    "Power-of-two scales, other granularities and group sizes never reach the kernel; an x saved in high precision is quantized by torch's passes."
    g = torch.Generator().manual_seed(2)
    x, w, dy = torch.randn(256, 256, generator=g), torch.randn(128, 256, generator=g) / 16, torch.randn(256, 128, generator=g)
    with fused_grad_quantizers(True): new = run_backward(x.to(DEVICE), w.to(DEVICE), dy.to(DEVICE), recipe)
    with fused_grad_quantizers(False): old = run_backward(x.to(DEVICE), w.to(DEVICE), dy.to(DEVICE), recipe)
    assert kernel_calls == {"requantize": 0}
    for a, b in zip(old, new):
        assert (a is None and b is None) or torch.equal(a, b)


@needs_kernels
@pytest.mark.parametrize("checkpointing", [False, True])
def test_siblings_share_wgrads_x_operand(checkpointing, kernel_calls):
    """q, k and v reading one input: Wgrad's x operand (requantized from the one saved FP8 copy) is made once, not three
    times, with activation checkpointing too (the recomputed forward counts its readers again), and nothing of it is
    left on the saved bytes after the backward; each dW is the dW of that linear run alone."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 150, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    ws = [(torch.randn(n, 256, generator=g) / 16).to(torch.bfloat16).to(DEVICE) for n in (256, 128, 128)]
    dys = [torch.randn(2, 150, w.shape[0], generator=g).to(torch.bfloat16).to(DEVICE) for w in ws]
    xi, wi = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws]
    def q_k_v(xi, *wi): return tuple(FP8LinearFunction.apply(xi, w, None, RECIPE) for w in wi)
    with fused_grad_quantizers(True):
        ys = torch.utils.checkpoint.checkpoint(q_k_v, xi, *wi, use_reentrant=False) if checkpointing else q_k_v(xi, *wi)
        torch.autograd.backward(ys, dys)
        assert kernel_calls["requantize"] == 1
        # x's FP8 copy, remembered on x (checkpointed: the recomputed forward found it there and counted it again)
        saved = xi._jetrl_input_fp8[3].data
        assert not hasattr(saved, "_jetrl_wgrad_input")              # dropped: by the last reader, or at the pass's end
        for w, dy, shared in zip(ws, dys, wi):
            _, dw, _ = run_backward(x, w, dy, RECIPE, grads=(False, True))
            assert torch.equal(dw, shared.grad)
    assert kernel_calls["requantize"] == 1 + 3                                           # alone: one each


@needs_kernels
def test_wgrad_operand_dropped_when_a_sibling_sits_out_the_backward(kernel_calls):
    "A backward that reaches only two of three siblings (or one) still drops the shared operand when it ends."
    g = torch.Generator().manual_seed(4)
    xi = torch.randn(160, 256, generator=g).to(torch.bfloat16).to(DEVICE).requires_grad_()
    wi = [(torch.randn(128, 256, generator=g) / 16).to(torch.bfloat16).to(DEVICE).requires_grad_() for _ in range(3)]
    with fused_grad_quantizers(True):
        ys = [FP8LinearFunction.apply(xi, w, None, RECIPE) for w in wi]
        saved = ys[0].grad_fn.saved_tensors[0]
        assert saved._jetrl_wgrad_readers == 3
        torch.autograd.grad(ys[0].sum() + ys[1].sum(), [wi[0], wi[1]])
    assert kernel_calls["requantize"] == 1
    assert not hasattr(saved, "_jetrl_wgrad_input")


# ---- routing and errors (these run everywhere, Triton or not) ----

def test_default_routing_keeps_the_cpu_path():
    assert not fused_grad_quantizers_active("cpu")
    with fused_grad_quantizers(False): assert not fused_grad_quantizers_active("cuda")
    assert fused_grad_quantizers_active("cuda") == HAS_TRITON       # by default: any CUDA tensor, where Triton is installed


def test_forcing_the_kernels_without_triton_fails_clearly():
    if HAS_TRITON:
        with fused_grad_quantizers(True): assert fused_grad_quantizers_active("cpu")
    else:
        with pytest.raises(RuntimeError, match="needs Triton"):
            with fused_grad_quantizers(True): pass
    assert not fused_grad_quantizers_active("cpu")          # restored on the way out


@pytest.mark.skipif(invariant_kernels_available("cpu"), reason="the interpreter runs the kernels on the CPU")
def test_kernels_on_a_cpu_tensor_fail_clearly():
    x_fp8 = quantize_unchecked(torch.randn(4, 8), (1, G))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        requantize_for_wgrad(x_fp8)


def test_bad_inputs_fail_before_any_work():
    x32 = torch.randn(256, 256)
    with pytest.raises(ValueError, match="Unknown FP8 format"): requantize_for_wgrad(quantize_unchecked(x32, (1, G)), fmt="e3m4")
    with pytest.raises(ValueError, match="1x128 groups"): requantize_for_wgrad(quantize_unchecked(x32, (128, 128)))
    with pytest.raises(ValueError, match="1x128 groups"): requantize_for_wgrad(quantize_unchecked(x32, (1, 64)))
    with pytest.raises(ValueError, match="backward's dtype"): requantize_for_wgrad(quantize_unchecked(x32, (1, G)), torch.float64)
    assert torch.float64 not in HP_DTYPES


@needs_kernels
def test_fp8_gemm_default_launch_gives_a_row_the_same_bits_at_every_row_count():
    """The forward's FP8 GEMM (jetrl.kernels.gemm) at the row counts where its launch changes: 64-row decode tiles (pointer
    loads with 16-column strips, TMA with wider strips; one to four row tiles), 128-row decode tiles
    for wide weights (TMA; one or two row tiles; on a GPU only: the interpreter is slow at such widths) and the
    trainer's 64 x 128 TMA tiles reading one weight scale per K block; every row must keep the bits it has among 300
    rows. Ragged K and N (3 K blocks, the last partial; the last weight block partial)."""
    from jetrl.fp8 import quantize, kernel_weight_scale
    from jetrl.kernels import quantize_1x128, fp8_gemm_invariant, fp8_gemm_tiles, loads_through_tma, DECODE_MAX_ROWS
    M, K = DECODE_MAX_ROWS + 44, 2 * G + 16
    g = torch.Generator().manual_seed(0)
    x = quantize_1x128(torch.randn(M, K, generator=g).to(DEVICE, torch.bfloat16))
    launches = set()
    for N in (200, 2200) + ((16500,) if DEVICE == "cuda" else ()):           # 16- and 64-column strips; wide weights
        w = quantize((torch.randn(N, K, generator=g) / K ** 0.5).to(DEVICE), (G, G))
        full = fp8_gemm_invariant(x, w, torch.bfloat16, kernel_weight_scale(w))
        assert loads_through_tma(M, fp8_gemm_tiles(M, N, K)) and fp8_gemm_tiles(M, N, K)[1] == G
        for rows in (1, 64, 65, 128, 129, DECODE_MAX_ROWS):
            tiles = fp8_gemm_tiles(rows, N, K)
            launches.add((tiles[0], loads_through_tma(rows, tiles), -(-rows // tiles[0])))   # (rows, TMA, row tiles)
            part = FP8Tensor(x.data[:rows], x.scale[:rows], x.block, x.fmt)
            assert torch.equal(fp8_gemm_invariant(part, w, torch.bfloat16), full[:rows]), f"{rows} rows ({tiles}): other bits"
    every = {(64, True, 1), (64, False, 2), (64, False, 4), (64, True, 2), (64, True, 3), (64, True, 4)}
    if DEVICE == "cuda": every |= {(128, True, 1), (128, True, 2)}
    assert every <= launches, every - launches                             # every decode launch was exercised


# ---- cuBLAS for many-row FP8 GEMMs only where it gives the kernel's bits (jetrl.kernels.gemm.fast_if_same_bits) ------
# The decision is plain Python: run here with stand-ins for cuBLAS and the kernel (the H200 test runs the real ones).

def test_fast_gemm_used_only_where_it_gives_the_exact_bits():
    from jetrl.kernels.gemm import fast_if_same_bits, _fast_chosen
    torch.manual_seed(0)
    exact = torch.randn(300, 8)
    asked = []
    def exact_gemm(): asked.append(1); return exact.clone()
    try:
        assert torch.equal(fast_if_same_bits(("test", "agrees"), exact.clone, exact_gemm), exact)
        assert torch.equal(fast_if_same_bits(("test", "agrees"), exact.clone, exact_gemm), exact)
        assert len(asked) == 1                                                      # checked once per key
        for row in (0, 150, 299):                    # a one-ulp difference anywhere is caught
            off = exact.clone(); off[row, 5] = torch.nextafter(off[row, 5], torch.tensor(float("inf")))
            calls = []
            fast = lambda: calls.append(1) or off.clone()
            assert fast_if_same_bits(("test", "off", row), fast, exact_gemm) is None
            assert fast_if_same_bits(("test", "off", row), fast, exact_gemm) is None
            assert len(calls) == 1                                                  # never asked again
        assert fast_if_same_bits(("test", "unseen"), exact.clone, exact_gemm, capturing=True) is None
        assert ("test", "unseen") not in _fast_chosen                               # decided on an eager call
        zeros = torch.zeros(4, 8)                    # -0.0 == +0.0 as values, not as bits: caught
        assert fast_if_same_bits(("test", "sign"), lambda: -zeros, lambda: zeros) is None
        def refuses(): raise RuntimeError("cuBLAS: layout not supported")
        assert fast_if_same_bits(("test", "refused"), refuses, exact_gemm) is None   # a refusal: the exact kernel
        assert _fast_chosen[("test", "refused")] is False
        with_nan = exact.clone(); with_nan[7, 3] = float("nan")                    # a diverged batch: NaN bits differ
        other_nan = with_nan.clone(); other_nan.view(torch.int32)[7, 3] ^= 1
        assert fast_if_same_bits(("test", "nan"), lambda: other_nan, lambda: with_nan) is None
        assert ("test", "nan") not in _fast_chosen                                  # no verdict from that call
        assert torch.equal(fast_if_same_bits(("test", "nan"), exact.clone, exact_gemm), exact)   # the next one decides
        assert _fast_chosen[("test", "nan")] is True
        assert fast_if_same_bits(("test", "nan off"), lambda: off, lambda: with_nan) is None   # NaN and a real difference:
        assert _fast_chosen[("test", "nan off")] is False                           # a verdict all the same
    finally:
        for key in [k for k in _fast_chosen if k[0] == "test"]: del _fast_chosen[key]
