"""Tests of the trainer's backward kernels in `jetrl.kernels` (`kernels.norm`, `kernels.mlp`, `kernels.head`, ...): `rms_norm_backward` (dx and dweight of RMSNorm) and
`silu_mul_backward` (d_gate and d_up of the gated MLP's `silu(gate) * up`) against the plain-torch references, and a
model's gradients with them on and off. The kernels run where Triton runs: on a CUDA GPU, or on the CPU under
Triton's interpreter

    TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels.py        (Triton installed; ~4 minutes on 2 cores)

Elsewhere (CI: no Triton) the kernel tests are skipped and only the routing and input checks run.

Tolerances. The kernels compute in fp32 and round where autograd rounds, so they agree with autograd's recompute
within a bf16 rounding: an element of dx may differ by one bf16 ulp (2^-7 relative at most) where the two fp32
values, apart by their order of summation (~1e-7 relative), straddle a rounding boundary; `DX_ULPS`. Where heavy
cancellation makes dx tiny, that fp32 difference itself shows: an absolute 1e-5 of the row's largest value. dweight
sums over rows in another order (and each term holds `normed.to(bf16)`, whose rounding flips as dx's do): within
2^-10 of its norm, a quarter of one bf16 rounding (`DWEIGHT_REL`); observed ~3e-5. The SiLU-mul kernel rounds each
output once from fp32, so it lies within one bf16 ulp of the exact (float64) value; torch's ops round `d_out * up`
and `silu(gate)` first too, so the two lie within 2^-6 (four half-ulps) of each other.

Triton 3.6's interpreter truncates its fp32 -> bf16 casts (`00k_grad_kernels`), where the GPU rounds to nearest even:
up to a whole ulp off at every cast. The `gpu_casts` fixture gives the interpreter the GPU's cast, so
these bounds hold on the CPU as on a GPU."""
import numpy as np
import math
import pytest
import torch
import torch.nn.functional as F

import jetrl.kernels.attention, jetrl.kernels.head, jetrl.kernels.mlp, jetrl.kernels.norm
from jetrl.kernels import (INTERPRETING, NORM_BACKWARD_PROGRAMS, backward_kernels, backward_kernels_active,
                           invariant_kernels_available, rms_norm_backward, silu_mul_backward)
from jetrl.kernels.norm import _rms_norm_backward_autograd
from jetrl.options import KernelOptions, use_kernel_options

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not invariant_kernels_available(DEVICE),
                                   reason="needs Triton: a CUDA GPU, or TRITON_INTERPRET=1 on the CPU")
needs_cpu_kernels = pytest.mark.skipif(not invariant_kernels_available("cpu"),   # test_memory's model lives on the CPU
                                       reason="a CPU model through the kernels: needs TRITON_INTERPRET=1")
BF16_ULP_REL = 2**-7      # one bf16 ulp, relative to the value, at most (8 significant bits)
DX_ULPS = 1               # dx: one rounding flip at most
CANCELLATION_ABS = 1e-5   # of the largest |value|: fp32 differences left where a value nearly cancels
DWEIGHT_REL = 2**-10      # dweight: norm of the difference over the norm of autograd's
SILU_VS_EXACT_REL = 2**-7     # the kernel: one rounding of an fp32 value (half an ulp), with room for fp32's own error
SILU_VS_TORCH_REL = 2**-6     # the kernel against torch's ops, which round up to three times


@pytest.fixture
def gpu_casts(monkeypatch):
    """Under Triton's interpreter, fp32 -> bf16 and fp32 -> FP8 casts rounded to nearest even by torch, as the GPU's
    (the interpreter's own truncate, and turn a NaN into a finite code), FP8 -> fp32 decoded by torch (the
    interpreter's own reads E4M3's NaN code as 480), and BF16 dots of the values (the interpreter's multiplies their
    bits as integers), exact products summed in fp32 as the GPU's tensor cores. On a GPU: nothing."""
    if not INTERPRETING: return
    import triton.language as tl
    from triton.runtime import interpreter
    truncating = interpreter.InterpreterBuilder.cast_impl
    formats = {tl.bfloat16: (torch.bfloat16, torch.int16, np.uint16),          # bf16 lives in uint16 there, FP8 in uint8
               tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8, np.uint8), tl.float8e5: (torch.float8_e5m2, torch.uint8, np.uint8)}
    decoded = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    def by_torch(src, dst_type) -> bool:
        return ((src.dtype.scalar == tl.float32 and dst_type.scalar in formats)
                or (src.dtype.scalar in decoded and dst_type.scalar == tl.float32))
    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar in formats:
            dtype, bits, np_bits = formats[dst_type.scalar]
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(dtype).view(bits)
            return interpreter.TensorHandle(rounded.numpy().view(np_bits), dst_type.scalar)
        if src.dtype.scalar in decoded and dst_type.scalar == tl.float32:
            codes = torch.from_numpy(np.ascontiguousarray(src.data).view(np.uint8)).view(decoded[src.dtype.scalar])
            return interpreter.TensorHandle(codes.float().numpy(), tl.float32)
        return truncating(self, src, dst_type)
    fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp                # FP8 casts come this way
    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if by_torch(src, dst_type): return cast_impl(self, src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)
    dot = interpreter.InterpreterBuilder.create_dot                          # bf16 products: of the values, in fp32
    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 == b.dtype.scalar:
            a, b = (interpreter.TensorHandle(torch.from_numpy(np.ascontiguousarray(t.data).view(np.int16))
                                             .view(torch.bfloat16).float().numpy(), tl.float32) for t in (a, b))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: float = DX_ULPS):
    "Every element within `ulps` bf16 ulps of `want` (relative), or within CANCELLATION_ABS of its largest value."
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    got, want = got.double(), want.double()
    bound = ulps * BF16_ULP_REL * want.abs() + CANCELLATION_ABS * want.abs().max()
    worst = ((got - want).abs() - bound).max().item()
    assert worst <= 0, f"an element is {worst:.2e} past {ulps} ulp(s)"


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def norm_inputs(shape, weight_dtype, x_dtype=torch.bfloat16, seed=0, strided_dy=True):
    "x, weight, and dy in y's dtype (the promotion), dy a non-contiguous view when `strided_dy`."
    g = torch.Generator().manual_seed(seed)
    H = shape[-1]
    x = torch.randn(shape, generator=g).to(x_dtype)
    weight = (torch.rand(H, generator=g) + 0.5).to(weight_dtype)
    y_dtype = torch.promote_types(x_dtype, weight_dtype)
    # the view is taken on DEVICE: copying a strided CPU view to a GPU gives a contiguous tensor
    dy = torch.randn(*shape[:-1], 2 * H, generator=g).to(DEVICE, y_dtype)[..., ::2] if strided_dy else \
        torch.randn(shape, generator=g).to(DEVICE, y_dtype)
    return x.to(DEVICE), weight.to(DEVICE), dy


# ---- RMSNorm's backward ----

@needs_kernels
@pytest.mark.parametrize("H", [96, 200, 8192])                   # 200: masked columns; 8,192: the widest asked for
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("programs", [NORM_BACKWARD_PROGRAMS, 4])  # one row per program, or ten rows of 39 each
def test_rms_norm_backward_matches_autograd(H, weight_dtype, programs, gpu_casts):
    x, weight, dy = norm_inputs((3, 13, H), weight_dtype)          # 3-D, 39 rows, dy strided
    assert not dy.is_contiguous()
    dx, dweight = rms_norm_backward(x, weight, dy, 1e-6, programs=programs)
    want_dx, want_dweight = _rms_norm_backward_autograd(x, weight, dy, 1e-6)
    assert_within_ulps(dx, want_dx)
    assert dweight.dtype == weight.dtype and dweight.shape == weight.shape
    assert relative(dweight, want_dweight) <= DWEIGHT_REL


@needs_kernels
def test_rms_norm_backward_fp32_input_agrees_to_fp32_rounding():
    "x and weight in fp32: no bf16 rounding anywhere, so the kernel and autograd differ by fp32's order of sums alone."
    x, weight, dy = norm_inputs((37, 200), torch.float32, x_dtype=torch.float32)
    dx, dweight = rms_norm_backward(x, weight, dy, 1e-5, programs=5)
    want_dx, want_dweight = _rms_norm_backward_autograd(x, weight, dy, 1e-5)
    assert relative(dx, want_dx) < 1e-5 and relative(dweight, want_dweight) < 1e-5


@needs_kernels
@pytest.mark.parametrize("need_dx, need_dweight", [(True, False), (False, True)])
def test_rms_norm_backward_one_gradient(need_dx, need_dweight, gpu_casts):
    x, weight, dy = norm_inputs((2, 9, 200), torch.float32)
    both = rms_norm_backward(x, weight, dy, 1e-6, programs=4)
    one = rms_norm_backward(x, weight, dy, 1e-6, need_dx, need_dweight, programs=4)
    for asked, got, full in zip((need_dx, need_dweight), one, both):
        assert (got is None) if not asked else torch.equal(got, full)


@needs_kernels
def test_rms_norm_backward_of_no_rows():
    x, weight, dy = norm_inputs((0, 200), torch.float32, strided_dy=False)
    dx, dweight = rms_norm_backward(x, weight, dy, 1e-6)
    assert dx.shape == (0, 200) and torch.equal(dweight, torch.zeros_like(weight))


def test_rms_norm_backward_checks_shapes():
    x, weight, dy = norm_inputs((4, 200), torch.float32)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_backward(x, weight[:100], dy, 1e-6)
    with pytest.raises(ValueError, match="dy"):
        rms_norm_backward(x, weight, dy[:2], 1e-6)


# ---- the MLP's SiLU-mul backward ----

def silu_mul_inputs(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype).to(DEVICE) for _ in range(3)]


def exact_silu_mul_grads(gate, up, d_out):
    "(d_gate, d_up) in float64 from the same inputs: the exact values."
    g, u, d = gate.double(), up.double(), d_out.double()
    s = torch.sigmoid(g)
    return d * u * s * (1 + g * (1 - s)), d * g * s


@needs_kernels
@pytest.mark.parametrize("shape", [(3, 7, 200), (5, 1000)])       # 4,200 and 5,000 values: a partial last block
def test_silu_mul_backward_matches_exact_and_torch(shape, gpu_casts):
    gate, up, d_out = silu_mul_inputs(shape)
    d_gate, d_up = silu_mul_backward(gate, up, d_out)
    assert d_gate.dtype == d_up.dtype == torch.bfloat16
    for got, exact in zip((d_gate, d_up), exact_silu_mul_grads(gate, up, d_out)):
        assert_within_ulps(got.double(), exact, ulps=SILU_VS_EXACT_REL / BF16_ULP_REL)
    torch_d_gate, torch_d_up = torch.ops.aten.silu_backward(d_out * up, gate), d_out * F.silu(gate)
    assert_within_ulps(d_gate, torch_d_gate, ulps=SILU_VS_TORCH_REL / BF16_ULP_REL)
    assert_within_ulps(d_up, torch_d_up, ulps=SILU_VS_TORCH_REL / BF16_ULP_REL)


@needs_kernels
def test_silu_mul_backward_one_gradient_and_strided_inputs():
    gate, up, d_out = silu_mul_inputs((6, 300))
    both = silu_mul_backward(gate, up, d_out)
    d_gate, none = silu_mul_backward(gate, up, d_out, need_d_up=False)
    none_too, d_up = silu_mul_backward(gate, up, d_out, need_d_gate=False)
    assert none is None and none_too is None and torch.equal(d_gate, both[0]) and torch.equal(d_up, both[1])
    strided = silu_mul_backward(gate.t().contiguous().t(), up, d_out.t().contiguous().t())     # column-major views
    assert torch.equal(strided[0], both[0]) and torch.equal(strided[1], both[1])


def test_silu_mul_backward_checks_shapes():
    gate, up, d_out = silu_mul_inputs((4, 10))
    with pytest.raises(ValueError, match="one shape"):
        silu_mul_backward(gate, up[:2], d_out)


# ---- which backward runs, and a model's gradients with the kernels on and off ----

def test_backward_kernels_routing():
    assert not backward_kernels_active("cpu")                   # the CPU keeps the torch ops, interpreter or not
    with backward_kernels(False): assert not backward_kernels_active(DEVICE)
    with backward_kernels(True): assert backward_kernels_active("cpu") == invariant_kernels_available("cpu")
    assert backward_kernels_active(DEVICE) == (DEVICE == "cuda" and invariant_kernels_available(DEVICE))


def tiny_qwen2_grads(kernels: bool, dtype: torch.dtype, seed: int = 0):
    "Gradients of a loss through the trainer's forward (`sequence_forward`) of a 2-layer Qwen2 on the invariant kernels."
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from jetrl.kernels import use_invariant_kernels
    from jetrl.rollout import sequence_forward
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=100)).to(DEVICE, dtype)
    use_invariant_kernels(model, exact=False)                   # RMSNorm and attention: kernels; linears: torch's
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    mask = torch.ones_like(ids); mask[0, :3] = 0
    with backward_kernels(kernels):
        hidden = sequence_forward(model, ids, mask)
        torch.log_softmax(model.lm_head(hidden).float(), -1)[..., 5].sum().backward()
    return {name: p.grad.float() for name, p in model.named_parameters()}


@needs_kernels
def test_tiny_qwen2_gradients_same_with_backward_kernels_on_and_off(monkeypatch):
    """fp32: every gradient of the model within fp32 rounding (the kernels sum in another order). On the CPU this runs
    the kernels under the interpreter, in every norm and MLP of the model's backward."""
    calls = []
    def counted(name, module):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: calls.append(name) or kernel(*a, **k))
    counted("rms_norm_backward", jetrl.kernels.norm); counted("silu_mul_backward_quantized", jetrl.kernels.mlp)   # (without a copy)
    on = tiny_qwen2_grads(True, torch.float32)
    assert sorted(calls) == ["rms_norm_backward"] * 5 + ["silu_mul_backward_quantized"] * 2   # 2 x 2 layer norms + the final one
    calls.clear()
    off = tiny_qwen2_grads(False, torch.float32)
    assert calls == [] and on.keys() == off.keys()
    for name in on:
        assert relative(on[name], off[name]) < 1e-5, name


# ---- the head's log-probs: selective_log_softmax (forward and backward kernels) against the torch formula ----
# Forward: both sides upcast the logits exactly and compute in fp32; only the order of the sum (and exp/log's last
# bits) differ: within 1e-5 absolute of log-probs of magnitude ~10 (observed ~1e-6). Gradient: fp32 logits, within
# SELECTIVE_GRAD_REL of each element plus SELECTIVE_GRAD_ABS of the row's largest |gradient| (exp's and the order's
# fp32 differences; the target's element g * (1 - p) cancels where p is near 1); bf16 logits: one bf16 rounding flip
# at most (DX_ULPS), as for RMSNorm's dx.
from jetrl.kernels import VOCAB_BLOCK, same_bits, selective_log_softmax
from jetrl.kernels.head import _reference_selective_log_softmax, _selective_log_softmax_op

LOGPROB_ABS = 1e-5
SELECTIVE_GRAD_REL, SELECTIVE_GRAD_ABS = 1e-5, 1e-6
SELECTIVE_V = 2 * VOCAB_BLOCK + 37          # three blocks, the last one partial


def selective_inputs(n, V=SELECTIVE_V, dtype=torch.bfloat16, seed=0, row_stride_pad=0):
    "logits (n, V) spread like a head's (std 4), optionally a view with a longer row stride, and targets (n,) int64."
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, V + row_stride_pad, generator=g) * 4).to(DEVICE, dtype)[:, :V]    # the view on DEVICE
    targets = torch.randint(0, V, (n,), generator=g)
    return logits, targets.to(DEVICE)


def oracle_grad(logits, targets, T, grad):
    leaf = logits.detach().clone().requires_grad_()
    (d,) = torch.autograd.grad(_reference_selective_log_softmax(leaf, targets, T), leaf, grad)
    return d


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_selective_log_softmax_forward_matches_torch(dtype, T):
    logits, targets = selective_inputs(5, dtype=dtype, row_stride_pad=11)        # rows 11 elements apart beyond V
    assert not logits.is_contiguous()
    logp = selective_log_softmax(logits, targets, T)
    want = _reference_selective_log_softmax(logits, targets, T)
    assert logp.dtype == torch.float32 and logp.shape == (5,)
    assert (logp - want).abs().max().item() <= LOGPROB_ABS, (logp - want).abs().max().item()
    _, lse = _selective_log_softmax_op(logits, targets, T)
    assert torch.allclose(lse, torch.logsumexp(logits.float() / T, -1), atol=LOGPROB_ABS)


@needs_kernels
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_selective_log_softmax_is_batch_invariant(T):
    "A row's log-prob and gradient: the same bits alone (n = 1) as among five rows."
    logits, targets = selective_inputs(5)
    grad = torch.randn(5, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    many = logits.clone().requires_grad_()
    logp = selective_log_softmax(many, targets, T)
    logp.backward(grad)
    for i in (0, 3):
        one = logits[i:i + 1].clone().requires_grad_()
        logp_one = selective_log_softmax(one, targets[i:i + 1], T)
        logp_one.backward(grad[i:i + 1])
        assert same_bits(logp_one, logp[i:i + 1]) and same_bits(one.grad, many.grad[i:i + 1])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_selective_log_softmax_gradient_matches_autograd(dtype, T, gpu_casts):
    logits, targets = selective_inputs(5, dtype=dtype)
    targets[1] = int(logits[1].float().argmax())          # a row whose target is its likeliest token
    grad = torch.randn(5, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    leaf = logits.clone().requires_grad_()
    (selective_log_softmax(leaf, targets, T) * grad).sum().backward()     # an expanded (stride 0) gradient arrives
    want = oracle_grad(logits, targets, T, grad)
    assert leaf.grad.dtype == dtype
    if dtype == torch.bfloat16:
        assert_within_ulps(leaf.grad, want)
    else:
        bound = SELECTIVE_GRAD_REL * want.abs() + SELECTIVE_GRAD_ABS * want.abs().amax(1, keepdim=True)
        assert ((leaf.grad - want).abs() <= bound).all(), ((leaf.grad - want).abs() - bound).max().item()


@needs_kernels
def test_selective_log_softmax_kernel_gives_nan_for_a_target_outside_the_vocabulary():
    "The GPU path does not check target ids (no wait for the GPU): the kernel reads nothing stray and returns NaN."
    logits, targets = selective_inputs(3, V=300)
    targets[1] = 300
    targets[2] = -1
    logp, _ = _selective_log_softmax_op(logits, targets, 1.0)
    assert torch.isnan(logp[1:]).all() and not torch.isnan(logp[0])


@needs_kernels
def test_selective_log_softmax_of_no_rows():
    logits = torch.zeros(0, 300, device=DEVICE, requires_grad=True)
    logp = selective_log_softmax(logits, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    logp.sum().backward()
    assert logp.shape == (0,) and logits.grad.shape == (0, 300)


# ---- the row entropy: softmax_entropy's kernel (prepared, off by default) against the formula in float64 ----
# The kernel sums in fp32 in another order than torch's formula; H = log s - w / s stays within ENTROPY_ABS of the
# float64 value for rows of magnitude ~1-10 nats (observed ~1e-6), peaked rows (H ~ 1e-3) included.
from jetrl.kernels import softmax_entropy, entropy_from_log_softmax
from jetrl.kernels.head import _softmax_entropy_op, _reference_entropy

ENTROPY_ABS = 2e-5


def entropy_inputs(dtype, T):
    "Five rows over three blocks: spread like a head's, one peaked, one with -inf columns, one all equal (H = log V)."
    logits, _ = selective_inputs(5, dtype=dtype, row_stride_pad=11)
    logits[1] = (logits[1].float() * 30).to(dtype)                     # peaked: H near 0
    logits[2, 50:] = float("-inf")                                      # masked columns add nothing (not NaN)
    logits[3] = 0.5                                                     # uniform: H = log V exactly
    want = entropy_from_log_softmax(torch.log_softmax(logits.double().cpu() / T, -1)).to(DEVICE)
    return logits, want


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_softmax_entropy_kernel_matches_the_formula(dtype, T):
    logits, want = entropy_inputs(dtype, T)
    assert not logits.is_contiguous()
    got = softmax_entropy(logits, T)
    assert got.dtype == torch.float32 and got.shape == (5,) and not got.requires_grad
    assert (got - want).abs().max().item() <= ENTROPY_ABS, (got - want).abs().max().item()
    assert abs(got[3].item() - math.log(SELECTIVE_V)) <= ENTROPY_ABS
    assert 0 <= got[1].item() < 0.2                                     # the peaked row (H ~0.1), within ENTROPY_ABS too
    one = softmax_entropy(logits[2:3], T)                               # a row's value alone: the same bits
    assert same_bits(one, got[2:3])
    if dtype == torch.float32:                                          # a max jump so large that exp underflows
        huge = torch.tensor([[-2e38] * 5000 + [2e38] * 4000, [-1e35, 1e35] * 4500]).to(DEVICE)   # finite / T
        assert torch.isfinite(softmax_entropy(huge, T)).all()


def test_softmax_entropy_is_torchs_formula_when_off_and_rejects_bad_input(monkeypatch):
    "Off (and wherever Triton does not run): the formula itself; -inf columns give 0, not NaN; bad input: clear errors."
    assert KernelOptions().fused_entropy is True                        # the default: the kernel where Triton runs
    logits, _ = selective_inputs(4, V=300, dtype=torch.float32)
    logits[0, 10:] = float("-inf")
    with use_kernel_options(KernelOptions(fused_entropy=False)): got = softmax_entropy(logits, 0.7)
    assert torch.equal(got, _reference_entropy(logits, 0.7)) and torch.isfinite(got).all()
    logp_all = torch.log_softmax(logits.float() / 0.7, -1)
    assert torch.equal(got[1:], -(logp_all.exp() * logp_all).sum(-1)[1:])     # finite rows: the former formula's bits
    with pytest.raises(ValueError, match="logits \\(n, V >= 1\\)"): softmax_entropy(torch.zeros(3, 4, 5))
    with pytest.raises(ValueError, match="temperature"): softmax_entropy(logits, 0.0)


@pytest.mark.parametrize("T", [1.0, 0.7])
def test_selective_log_softmax_falls_back_to_the_torch_formula(T, monkeypatch):
    "Where the kernels do not run: the torch formula itself, the same bits and gradients; int32 targets too."
    monkeypatch.setattr(jetrl.kernels.head, "invariant_kernels_available", lambda device: False)
    logits, targets = selective_inputs(4, V=300)
    leaf, oracle_leaf = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    logp = selective_log_softmax(leaf, targets.int(), T)
    want = _reference_selective_log_softmax(oracle_leaf, targets, T)
    assert same_bits(logp, want)
    logp.sum().backward(); want.sum().backward()
    assert same_bits(leaf.grad, oracle_leaf.grad)


def test_selective_log_softmax_checks_its_inputs():
    logits, targets = selective_inputs(4, V=300, dtype=torch.float32)
    for bad, match in [(lambda: selective_log_softmax(logits[0], targets[:1]), r"logits \(n, V\)"),
                       (lambda: selective_log_softmax(logits.double(), targets), r"logits \(n, V\)"),
                       (lambda: selective_log_softmax(logits, targets[:3]), r"targets \(n,\)"),
                       (lambda: selective_log_softmax(logits, targets[:, None]), r"targets \(n,\)"),
                       (lambda: selective_log_softmax(logits, targets.float()), "integer ids"),
                       (lambda: selective_log_softmax(logits, targets, 0.0), "temperature > 0"),
                       (lambda: selective_log_softmax(logits, targets, -1.0), "temperature > 0"),
                       (lambda: selective_log_softmax(logits, targets, float("inf")), "temperature > 0"),
                       (lambda: selective_log_softmax(logits[:, :0], targets), "at least one column")]:
        with pytest.raises(ValueError, match=match): bad()
    if DEVICE == "cpu":                                       # checked where it costs no wait for a GPU
        for t in (300, -1):
            bad_targets = targets.clone(); bad_targets[2] = t
            with pytest.raises(ValueError, match=r"outside \[0, 300\)"): selective_log_softmax(logits, bad_targets)


@pytest.mark.parametrize("fused", [False, True], ids=["formula", "fused-head"])
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_sampler_and_trainer_share_the_head_formula(fused, T, monkeypatch):
    """With `KernelOptions.fused_head_log_probs` on, the sampler's log-prob of the token it picks and the trainer's
    log-prob of that token both come from selective_log_softmax (the kernels where Triton runs, here under the
    interpreter; the torch formula elsewhere): the same bits. Off, both from the torch formula."""
    import torch.nn as nn
    from jetrl.logprobs import _head_log_probs, fused_head_active
    from jetrl.sampling import sample_next, SamplingParams
    from jetrl.options import KernelOptions, use_kernel_options
    logits, _ = selective_inputs(5)
    logits = logits.to(DEVICE)
    with use_kernel_options(KernelOptions(fused_head_log_probs=fused)):
        tokens, sampled = sample_next(logits, SamplingParams(temperature=T, seed=0), torch.Generator(DEVICE).manual_seed(0))
        trainer, entropy = _head_log_probs(nn.Identity(), logits, tokens, T, True)
        assert fused_head_active(logits.device) is fused
    assert torch.equal(sampled, trainer)
    assert entropy is not None and torch.isfinite(entropy).all()
    torch.testing.assert_close(trainer.cpu(), _reference_selective_log_softmax(logits.cpu(), tokens.cpu(), T),
                               rtol=0, atol=1e-5)


def test_fused_head_is_on_by_default_on_a_gpu_only():
    """`KernelOptions.fused_head_log_probs = None` (the default): the head's target log-probs run selective_log_softmax's
    kernels on a GPU (8x torch's ops on an H200, benchmarks/results/head_logprobs_h200.jsonl) and torch's formula on the
    CPU, where the kernels
    would run only under the slow interpreter."""
    from jetrl.logprobs import fused_head_active
    from jetrl.options import KernelOptions
    assert KernelOptions().fused_head_log_probs is None
    assert fused_head_active("cpu") is False
    if torch.cuda.is_available(): assert fused_head_active("cuda") is True


# ---- the sampler's draw: race_sample's kernel, argmax of z - log E over a row's chunks ----
RACE_DRAWS = 1500
CHI2_999 = {3: 16.27}        # chi-square bounds that a sampler of p stays under 999 times in 1,000, by degrees of freedom


@needs_kernels
def test_race_sample_draws_softmax_across_chunks_and_blocks():
    """Four columns hold the mass, two in each of a row's two chunks (the second partial), in different blocks: the
    draws' counts pass a chi-square test against softmax(z / T) (a wrong sign of log E, or uniforms instead of Exp(1)
    draws, fails it by far); the -inf columns are never drawn; greedy takes the largest z, on a tie the earlier column
    (the chunks' winners compared in column order)."""
    from jetrl.kernels import race_sample, RACE_CHUNK
    V, T = RACE_CHUNK + 37, 0.8
    cols, z = torch.tensor([3, VOCAB_BLOCK + 100, RACE_CHUNK + 5, RACE_CHUNK + 36]), torch.tensor([1.0, 0.0, 0.5, -0.5])
    x = torch.full((RACE_DRAWS, V), float("-inf"))
    x[:, cols] = z
    drawn = race_sample(x.to(DEVICE), T, torch.Generator(DEVICE).manual_seed(0)).cpu()
    assert set(drawn.tolist()) <= set(cols.tolist())
    counts = torch.stack([(drawn == c).sum() for c in cols]).double()
    expected = RACE_DRAWS * torch.softmax(z.double() / T, -1)
    assert ((counts - expected) ** 2 / expected).sum().item() < CHI2_999[3], (counts, expected)
    tie = x[:2].clone()
    tie[:, cols[2]] = 1.0                                  # chunk 1 ties chunk 0's largest
    assert race_sample(tie.to(DEVICE), greedy=True).tolist() == [3, 3]


@needs_kernels
def test_race_sample_row_draw_depends_on_its_seed_index_and_logits_only():
    "Changing another row's logits leaves a row's draw as it was; another seed draws other tokens."
    from jetrl.kernels import race_sample
    logits, _ = selective_inputs(4)
    gen = lambda seed: torch.Generator(DEVICE).manual_seed(seed)
    drawn = race_sample(logits, 4.0, gen(5))                            # T = 4: a flat distribution over ~8,000 tokens
    other = logits.clone()
    other[2] = other[2].flip(0)
    again = race_sample(other, 4.0, gen(5))
    assert torch.equal(drawn[[0, 1, 3]], again[[0, 1, 3]])
    assert not torch.equal(drawn, race_sample(logits, 4.0, gen(6)))


# ---- quantization in the producer: RMSNorm and SiLU-mul write their output's FP8 copy ----

from jetrl.fp8 import quantize_unchecked
from jetrl.kernels import rms_norm_invariant, rms_norm_quantized, silu_mul, silu_mul_quantized
from jetrl.kernels.norm import _reference_rms_norm


def assert_scales_column_major(x_fp8):
    """1x128 scales (rows, groups) stored as cuBLAS's blockwise GEMM reads them, strides (1, rows) (a size-1 dimension's
    stride is moot): `jetrl.fp8._column_major` takes them without a copy."""
    from jetrl.fp8 import _column_major
    rows, groups = x_fp8.scale.shape
    if x_fp8.scale.numel() == 0: return                                               # no scales: no layout
    assert (groups == 1 or x_fp8.scale.stride(1) == rows) and (rows == 1 or x_fp8.scale.stride(0) == 1), x_fp8.scale.stride()
    assert _column_major(x_fp8.scale).data_ptr() == x_fp8.scale.data_ptr()


def assert_same_fp8_copy(y_fp8, y: torch.Tensor, fmt: str):
    "The producer's FP8 copy is the CPU quantizer's bytes and scales of the y it wrote, bit for bit, scales column-major."
    want = quantize_unchecked(y.reshape(-1, y.shape[-1]).cpu(), (1, 128), fmt)
    assert y_fp8.block == (1, 128) and y_fp8.fmt == fmt
    assert torch.equal(y_fp8.data.cpu().view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(y_fp8.scale.cpu(), want.scale)
    assert_scales_column_major(y_fp8)


@needs_kernels
@pytest.mark.parametrize("H", [96, 200, 896])                    # 96: one partial group; 200: a masked second group
@pytest.mark.parametrize("dtype, weight_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                 (torch.float32, torch.float32)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rms_norm_quantized_is_the_norm_then_the_quantizer(H, dtype, weight_dtype, fmt, gpu_casts):
    x, weight, _ = norm_inputs((3, 13, H), weight_dtype, x_dtype=dtype)
    x[1, 2] = 0                                                  # a zero row: scale 1
    y, y_fp8 = rms_norm_quantized(x, weight, 1e-6, fmt)
    assert torch.equal(y, rms_norm_invariant(x, weight, 1e-6))   # the same kernel's y, quantized or not
    assert_within_ulps(y.cpu().to(torch.promote_types(dtype, weight_dtype)),
                       _reference_rms_norm(x.cpu(), weight.cpu(), 1e-6), ulps=1)
    assert_same_fp8_copy(y_fp8, y, fmt)


@needs_kernels
@pytest.mark.parametrize("shape", [(3, 7, 200), (33, 256), (2, 896), (300, 256)])   # 300 rows: the trainer's tiles
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_silu_mul_quantized_is_torch_then_the_quantizer(shape, dtype, fmt, gpu_casts):
    g = torch.Generator().manual_seed(0)
    gate, up = ((torch.randn(shape, generator=g) * 4).to(dtype).to(DEVICE) for _ in range(2))
    up.view(-1, shape[-1])[1] = 0                                  # a zero row: scale 1
    y, y_fp8 = silu_mul_quantized(gate, up, fmt)
    assert torch.equal(y, silu_mul(gate, up))                      # the same kernel's y, quantized or not
    want = F.silu(gate) * up
    if DEVICE == "cuda": assert torch.equal(y, want)               # CUDA's expf and IEEE division: torch's bits
    else: assert_within_ulps(y.float(), want.float(), ulps=1)      # the interpreter's exp is numpy's
    assert_same_fp8_copy(y_fp8, y, fmt)


@needs_kernels
def test_silu_mul_quantized_reads_strided_halves(gpu_casts, gate_up_rows=37, N=256):
    "gate and up as the two halves of one fused gate/up output (rows strided by 2N), as the rollout's engine has them."
    g = torch.Generator().manual_seed(1)
    fused = torch.randn(gate_up_rows, 2 * N, generator=g).to(torch.bfloat16).to(DEVICE)
    gate, up = fused.split(N, dim=-1)
    y, y_fp8 = silu_mul_quantized(gate, up)
    y_contiguous, _ = silu_mul_quantized(gate.contiguous(), up.contiguous())
    assert torch.equal(y, y_contiguous)
    assert_same_fp8_copy(y_fp8, y, "e4m3")


@needs_kernels
def test_silu_mul_gradients_under_the_quantized_forward(gpu_casts):
    "The quantized forward keeps the same backward: gate and up saved, silu recomputed; the FP8 copy has no gradient."
    g = torch.Generator().manual_seed(2)
    gate, up, d_out = (torch.randn(5, 256, generator=g).to(DEVICE) for _ in range(3))
    a, b = gate.clone().requires_grad_(), up.clone().requires_grad_()
    y, y_fp8 = silu_mul_quantized(a, b)
    assert not y_fp8.data.requires_grad
    y.backward(d_out)
    a2, b2 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    (F.silu(a2) * b2).backward(d_out)
    torch.testing.assert_close(a.grad, a2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.grad, b2.grad, rtol=1e-5, atol=1e-6)


def test_silu_mul_rejects_mismatched_inputs():
    gate = torch.randn(4, 8)
    for up in (torch.randn(4, 7), torch.randn(4, 8, dtype=torch.float64)):
        with pytest.raises(ValueError, match="one shape, dtype and device"): silu_mul(gate, up)


@needs_kernels
@pytest.mark.parametrize("shape", [(5, 384), (3, 7, 256)])           # 1920 values: a partial last block of 1024
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grad_fmt", ["e4m3", "e5m2"])
def test_silu_mul_backward_writes_dgrads_fp8_copies(shape, dtype, grad_fmt, gpu_casts):
    """With a gradient format, the SiLU-mul's backward kernel also writes d_gate's and d_up's FP8 copies: the CPU
    quantizer's bytes and scales of the gradients it wrote, which are bit for bit the plain kernel's."""
    from jetrl.kernels import silu_mul_backward, silu_mul_backward_quantized
    g = torch.Generator().manual_seed(5)
    gate, up, d_out = ((torch.randn(shape, generator=g) * 3).to(dtype).to(DEVICE) for _ in range(3))
    d_out[0] = 0.0                                                      # a row of zero gradient: scale 1, codes 0
    plain = silu_mul_backward(gate, up, d_out)
    d_gate, d_up, (gate_fp8, up_fp8) = silu_mul_backward_quantized(gate, up, d_out, grad_fmt)
    assert same_bits(d_gate, plain[0]) and same_bits(d_up, plain[1])
    assert_same_fp8_copy(gate_fp8, d_gate, grad_fmt)
    assert_same_fp8_copy(up_fp8, d_up, grad_fmt)
    only_up = silu_mul_backward_quantized(gate, up, d_out, grad_fmt, need_d_gate=False)
    assert only_up[0] is None and only_up[2][0] is None and same_bits(only_up[1], d_up)
    assert_same_fp8_copy(only_up[2][1], d_up, grad_fmt)
    for need in ((True, True), (True, False), (False, True)):        # through the dispatcher (torch.compile's way):
        torch.ops.jetrl.silu_mul_backward(gate, up, d_out, *need, None)   # outputs that alias each other would raise


def test_silu_mul_backward_copies_need_whole_groups():
    from jetrl.kernels import silu_mul_backward_quantized
    x = torch.randn(4, 200)
    with pytest.raises(ValueError, match="not a multiple of 128"): silu_mul_backward_quantized(x, x, x, "e4m3")
    with pytest.raises(ValueError): silu_mul_backward_quantized(x, x, x, "e3m4")


def handover_on_and_off(monkeypatch, switch: str, counted_call: tuple, checkpointing: bool) -> tuple[int, int]:
    """A 2-layer jet model's forward and backward with the handover `switch` (a KernelOptions field) on, then off: the gradients
    must be the same bits; returns the linears' own `_quantize` calls of `counted_call` (operand, gemm) in each run."""
    import jetrl.linear as linear
    from test_memory import make_policy, gradients
    calls = []
    quantize = linear._quantize
    def counted(t, recipe, operand, gemm, transposed_layout=False):
        if (operand, gemm) == counted_call: calls.append(t.shape)
        return quantize(t, recipe, operand, gemm, transposed_layout)
    monkeypatch.setattr(linear, "_quantize", counted)
    runs = {}
    for on in (True, False):
        calls.clear()
        with use_kernel_options(KernelOptions(**{switch: on})):
            runs[on] = gradients(make_policy("jet", "bfloat16", checkpointing)), len(calls)
    assert all(torch.equal(a, b) for a, b in zip(runs[True][0], runs[False][0]))
    return runs[True][1], runs[False][1]


@needs_cpu_kernels
@pytest.mark.parametrize("checkpointing", [False, True])
def test_silu_mul_backward_hands_gate_and_up_their_dy(checkpointing, gpu_casts, monkeypatch):
    """A jet model's forward and backward with the SiLU-mul's backward quantizing gate's and up's dy
    (`quantize_dy_in_producers`) gives the bits of each linear quantizing its own dy, and the linears' own Dgrad
    quantizer runs for 5 of a layer's 7 dys (q, k, v, o, down) where it ran for 7."""
    from test_memory import LAYERS
    from jetrl.kernels import backward_kernels
    with backward_kernels(True):                                        # as on a GPU (the interpreter's default: off)
        handed_over, own = handover_on_and_off(monkeypatch, "quantize_dy_in_producers", ("dy", "dgrad"), checkpointing)
    assert (handed_over, own) == (5 * LAYERS, 7 * LAYERS)


@needs_cpu_kernels
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("as_decode", [False, True])
def test_producers_hand_over_the_bytes_the_linears_would_make(checkpointing, as_decode, gpu_casts, monkeypatch):
    """A jet model's forward and backward with the norms and the SiLU-mul quantizing for their FP8 linears give the bits
    of the linears quantizing themselves (`KernelOptions(quantize_in_producers=False)`), and the linears' own quantizer runs only for
    the inputs no producer of jetrl's makes (attention's output, for o_proj): one call per layer where it ran four.
    This batch's 120 rows counted as decode's (`PRODUCER_MAX_DECODE_ROWS` as it is): the norms leave their inputs to
    the linears, the SiLU-mul still writes the down projection's, three calls per layer."""
    import jetrl.linear as linear
    from test_memory import LAYERS, ROWS, SEQ
    assert ROWS * SEQ <= linear.PRODUCER_MAX_DECODE_ROWS
    if not as_decode: monkeypatch.setattr(linear, "PRODUCER_MAX_DECODE_ROWS", 0)   # these rows in the norms' kernels too
    handed_over, own = handover_on_and_off(monkeypatch, "quantize_in_producers", ("x", "fprop"), checkpointing)
    forwards = 2 if checkpointing else 1                     # a checkpointed layer runs its forward again in backward
    left_to_the_linears = 3 if as_decode else 1              # of a layer's four inputs
    assert (handed_over, own) == (left_to_the_linears * LAYERS * forwards, 4 * LAYERS * forwards)


# ---- the rotary embedding in one kernel ----

from jetrl.kernels import rotate_half_kernel, write_kv_cache, new_kv_codes, quantize_kv
from jetrl.kernels.attention import _rotary_torch


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["transposed", "contiguous", "fused-split"])
@pytest.mark.parametrize("T", [37, 1])                          # a partial tile; decode's one position
def test_rotary_kernel_gives_torch_bits_and_autograds_gradient(dtype, layout, T, gpu_casts, monkeypatch):
    """q as the engine has it: a (b, T, heads, d) view transposed to (b, heads, T, d), contiguous, or a split of the fused
    q/k/v output (not dense). The kernel's output is torch's ops' bit for bit, signed zeros included (x = +0 with
    cos < 0 and sin > 0), in the strides torch gives; its gradient, by the kernel's backward, is autograd's bit for bit
    (signed zeros too: dy = +0 in one row)."""
    g = torch.Generator().manual_seed(0)
    b, heads, d = 2, 3, 64
    if layout == "fused-split":                                   # q of a fused q/k/v output: rows strided past q
        raw = (torch.randn(b, T, 2 * heads * d, generator=g) * 3).to(dtype)[..., : heads * d].view(b, T, heads, d)
    else: raw = (torch.randn(b, T, heads, d, generator=g) * 3).to(dtype)
    raw[0, 0, 0] = 0.0                                            # +0 everywhere in one head's row
    x = raw.transpose(1, 2) if layout != "contiguous" else raw.transpose(1, 2).contiguous()
    # cos/sin halves of independent angles (a model's halves repeat: a kernel mixing them up would pass there)
    angles = torch.randn(b, T, d, generator=g) * 10
    angles[0, 0] = 2.0                                            # cos < 0, sin > 0: torch gives -0 + -0 = -0 there
    cos, sin = torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)
    x, cos, sin = x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)
    assert jetrl.kernels.attention._rotary_kernel_runs(x, cos, sin)
    y = rotate_half_kernel(x, cos, sin)
    want = _rotary_torch(x, cos, sin)
    assert torch.signbit(want[0, 0, 0, : d // 2]).all()          # the zeros the test is about are there
    layout_of = lambda t: [stride for stride, n in zip(t.stride(), t.shape) if n > 1]     # a size-1 dim's stride is moot
    assert same_bits(y, want) and layout_of(y) == layout_of(want)
    a, r = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn(want.shape, generator=g).to(dtype)
    dy[0, 0, 0] = 0.0                                             # +0: dx2 = -0 - (+0) = -0 there, as autograd gives
    dy = dy.to(DEVICE)
    out = rotate_half_kernel(a, cos, sin)
    assert type(out.grad_fn).__name__ == "_RotaryFunctionBackward"
    calls = []
    real_op = jetrl.kernels.attention._rotary_op
    monkeypatch.setattr(jetrl.kernels.attention, "_rotary_op", lambda *args, **kw: calls.append(kw) or real_op(*args, **kw))
    out.backward(dy)
    assert calls == [{"backward": True}]                          # the gradient came from the kernel
    _rotary_torch(r, cos, sin).backward(dy)
    assert torch.signbit(r.grad[0, 0, 0, d // 2:]).all()          # the zeros the gradient's check is about
    assert same_bits(a.grad, r.grad)
    # under create_graph the gradient must itself be differentiable (here in dy): torch's ops, the same bits
    a2, dy2 = x.clone().requires_grad_(), dy.clone().requires_grad_()
    (da,) = torch.autograd.grad(rotate_half_kernel(a2, cos, sin), a2, dy2, create_graph=True)
    assert da.requires_grad and same_bits(da, r.grad)


@needs_kernels
@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("T", [1, 19])                          # decode's one position; a prefill pass past one tile
def test_kv_cache_write_gives_the_separate_kernels_bits_at_its_columns_and_nothing_elsewhere(kv_fp8, T, gpu_casts):
    """The engine's cache write in one kernel: at each given column, the keys `rotate_half_kernel` gives (signed zeros
    included) and the values, as they are (BF16 cache) or as `quantize_kv`'s codes and scales (FP8 cache: keys
    token-major, values dim-major); every other column left as it was (NaN here, so a stray or a missing write shows).
    The queries of the same launch (two per key/value head) come out as `rotate_half_kernel` rotates them."""
    g = torch.Generator().manual_seed(3)
    b, heads, d, capacity = 2, 3, 64, 40
    k, v = ((torch.randn(b, T, heads, d, generator=g) * 3).to(torch.bfloat16).transpose(1, 2) for _ in range(2))
    q = (torch.randn(b, T, 2 * heads, d, generator=g) * 3).to(torch.bfloat16).transpose(1, 2)
    q[1, 4, 0] = 0.0
    k[0, 0, 0] = 0.0                                              # the engine's (b, T, heads, d) views, a row of +0
    angles = torch.randn(b, T, d, generator=g) * 10
    angles[0, 0] = 2.0                                            # cos < 0, sin > 0: -0 from torch's ops there
    cos, sin = torch.cos(angles).to(torch.bfloat16), torch.sin(angles).to(torch.bfloat16)
    columns = torch.randperm(capacity, generator=g)[:T]          # any distinct columns, in any order (int64)
    k, v, q, cos, sin, columns = (t.to(DEVICE) for t in (k, v, q, cos, sin, columns))
    def nan(codes):                                               # every code NaN (0x7F), the FP8 view kept
        codes.view(torch.uint8).fill_(0x7F)
        return codes
    if kv_fp8:
        cache = (nan(new_kv_codes(b, heads, capacity, d, DEVICE)), nan(new_kv_codes(b, heads, capacity, d, DEVICE, True)),
                 *(torch.full((b, heads, capacity), float("nan"), device=DEVICE) for _ in range(2)))
    else: cache = tuple(torch.full((b, heads, capacity, d), float("nan"), dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    assert jetrl.kernels.attention._rotary_kernel_runs(k, cos, sin)
    q_rotated = write_kv_cache(k, v, q, cos, sin, cache, columns)
    assert same_bits(q_rotated, rotate_half_kernel(q, cos, sin))
    k_rotated = rotate_half_kernel(k, cos, sin)
    if kv_fp8:
        (k_codes, k_scales), (v_codes, v_scales) = quantize_kv(k_rotated), quantize_kv(v)
        wants = (k_codes, v_codes, k_scales, v_scales)
    else: wants = (k_rotated, v)
    as_bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    untouched = lambda t: (t.view(torch.uint8) == 0x7F).all() if t.dtype == torch.float8_e4m3fn else t.isnan().all()
    others = torch.ones(capacity, dtype=torch.bool, device=DEVICE)
    others[columns] = False
    for written, want in zip(cache, wants, strict=True):
        assert same_bits(as_bits(written[:, :, columns]), as_bits(want))
        assert untouched(written[:, :, others])


def test_rotary_kernel_is_on_by_default_and_falls_back():
    "The rotary embedding runs the kernel by default where Triton runs; shapes the kernel does not take run torch's ops."
    assert KernelOptions().rotary_kernel is True
    x, cos, sin = torch.randn(1, 2, 3, 6), torch.randn(1, 3, 6), torch.randn(1, 3, 6)        # d / 2 = 3: no kernel
    assert not jetrl.kernels.attention._rotary_kernel_runs(x, cos, sin)
    x, cos, sin = torch.randn(1, 2, 3, 8), torch.randn(1, 3, 8, requires_grad=True), torch.randn(1, 3, 8)
    assert not jetrl.kernels.attention._rotary_kernel_runs(x, cos, sin)     # cos/sin needing a gradient: torch's ops
    assert torch.equal(rotate_half_kernel(x, cos, sin), _rotary_torch(x, cos, sin))


def test_rotary_kernel_leaves_forward_ad_and_torch_func_to_torchs_ops(monkeypatch):
    "The kernel has no jvp and no vmap rule: dual tensors and torch.func's wrappers take torch's ops."
    monkeypatch.setattr(jetrl.kernels.attention, "invariant_kernels_available", lambda device: True)   # as on a GPU
    x, cos, sin = torch.randn(1, 2, 3, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    assert jetrl.kernels.attention._rotary_kernel_runs(x, cos, sin)
    with use_kernel_options(KernelOptions(rotary_kernel=False)):
        assert not jetrl.kernels.attention._rotary_kernel_runs(x, cos, sin)    # switched off: torch's ops
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        assert not jetrl.kernels.attention._rotary_kernel_runs(dual, cos, sin)
    seen = []
    torch.func.vmap(lambda row: seen.append(jetrl.kernels.attention._rotary_kernel_runs(row[None], cos, sin)) or row)(x)
    assert seen == [False]


# ---- the weight's 128x128 blocks in one pass ----

from jetrl.fp8 import FP8Tensor, fp8_max
from jetrl.kernels import quantize_128x128


def assert_same_weight_fp8(w_fp8, w: torch.Tensor, fmt: str):
    "The kernel's FP8 weight is the CPU quantizer's 128x128 blocks of w, bit for bit: the codes, the scales, the layout."
    want = quantize_unchecked(w.cpu(), (128, 128), fmt)
    assert w_fp8.block == (128, 128) and w_fp8.fmt == fmt and w_fp8.data.dtype == want.data.dtype
    assert w_fp8.data.shape == want.data.shape and w_fp8.scale.shape == want.scale.shape and w_fp8.scale.dtype == torch.float32
    assert torch.equal(w_fp8.data.cpu().view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(w_fp8.scale.cpu().view(torch.int32), want.scale.view(torch.int32))


def weight(shape, dtype, seed=0) -> torch.Tensor:
    "A weight-like (N, K): normal values of ~0.02, a few outliers, rounded to `dtype`."
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w.view(-1)[:: 97] *= 30                                       # outliers: codes of every size within a block
    return w.to(dtype)


@needs_kernels
@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (128, 1)])   # whole blocks; ragged both ways; one column
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_128x128_is_the_cpu_quantizer(shape, dtype, fmt, gpu_casts):
    w = weight(shape, dtype)
    assert_same_weight_fp8(quantize_128x128(w.to(DEVICE), fmt), w, fmt)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_128x128_special_blocks(dtype, fmt, gpu_casts):
    """Blocks that test the scale's edge cases: all zeros (signed zeros too: scale 1, codes +-0), one huge value among
    small ones (most codes FP8 subnormals or zero), values so tiny that amax / fp8_max underflows (the scale's floor,
    fp32's smallest normal), and a huge value in the ragged corner block (its padding must not count). The tiny values
    are normal numbers: Triton 3.6's interpreter widens bf16 subnormals to wrong fp32 values (`_convert_float`), where
    a GPU's widening is exact."""
    w = weight((300, 400), torch.float32, seed=1)                  # 3 x 4 blocks, the last row and column ragged
    w[:128, :128] = 0.0
    w[:64, :128] = -0.0                                            # half the zero block negative zeros
    big = 3e38 if dtype == torch.float32 else 1e38                 # near either format's largest
    w[128:256, :128] *= 1e-3
    w[200, 100] = big                                              # one huge value in block (1, 0)
    g = torch.Generator().manual_seed(2)
    tiny = (torch.rand(128, 128, generator=g) + 0.2) * 1e-37 * (torch.randint(0, 2, (128, 128), generator=g) * 2 - 1)
    w[:128, 128:256] = tiny                                        # amax / fp8_max below fp32's smallest normal
    w[299, 399] = -big / 3                                         # the ragged corner block's amax
    w = w.to(dtype)
    assert torch.signbit(w[:64, :128]).all() and w[:128, 128:256].abs().max() / fp8_max(fmt) < torch.finfo(torch.float32).tiny
    w_fp8 = quantize_128x128(w.to(DEVICE), fmt)
    assert w_fp8.scale[0, 0] == 1 and w_fp8.scale[0, 1] == torch.finfo(torch.float32).tiny   # the cases are there
    assert_same_weight_fp8(w_fp8, w, fmt)


def assert_same_fp8_but_nan_signs(got, want):
    "The CPU quantizer's scales and bytes, NaN in the same places (a NaN's sign bit may differ: its place may not)."
    assert torch.equal(got.scale.cpu(), want.scale)
    got_values, want_values = got.data.cpu().float(), want.data.float()
    assert torch.equal(got_values.isnan(), want_values.isnan())
    finite = ~want_values.isnan()
    assert torch.equal(got.data.cpu().view(torch.uint8)[finite], want.data.view(torch.uint8)[finite])


@needs_kernels
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_128x128_keeps_nan_and_inf_visible(dtype, fmt, gpu_casts):
    """A block holding NaN gets scale 1 and its NaN stays NaN, a block holding inf gets scale inf (inf / inf: NaN), as
    quantize_unchecked has them: a diverged weight must not turn into finite FP8 codes (Triton's max skips a NaN)."""
    w = torch.randn(256, 300, generator=torch.Generator().manual_seed(3)).to(dtype)
    w[5, 7] = w[140, 10] = float("nan"); w[130, 200], w[200, 290] = float("inf"), -float("inf")
    got, want = quantize_128x128(w.to(DEVICE), fmt), quantize_unchecked(w, (128, 128), fmt)
    assert_same_fp8_but_nan_signs(got, want)



@needs_kernels
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rows", [40, 300])                         # decode's 8-row tiles, the trainer's 16-row tiles
def test_quantize_1x128_keeps_nan_and_inf_visible(fmt, rows, gpu_casts):
    """A 1x128 group holding NaN gets scale 1 and its NaN stays NaN (its other values clamped at scale 1), a group
    holding inf gets scale inf, as quantize_unchecked has them. The interpreter's max skips a NaN as the GPU's does,
    so this test catches a lost NaN in the amax; its minimum and maximum keep NaN, so only the GPU twin in
    tests/test_gpu.py catches a clamp that turns NaN finite (and it runs the GPU's form of the amax)."""
    from jetrl.kernels import quantize_1x128
    x = (torch.randn(rows, 300, generator=torch.Generator().manual_seed(3)) * 500).to(torch.bfloat16)
    x[3, 7] = x[30, 290] = float("nan"); x[11, 200], x[12, 5] = float("inf"), -float("inf")
    got, want = quantize_1x128(x.to(DEVICE), fmt), quantize_unchecked(x, (1, 128), fmt)
    assert want.scale[3, 0] == 1 and want.scale[11, 1] == float("inf")          # the cases are there
    assert_same_fp8_but_nan_signs(got, want)

@needs_kernels
def test_fp8_gemm_reads_activation_scales_in_any_strides(gpu_casts):
    """jetrl's FP8 GEMM takes the 1x128 scales as the quantizers write them (column-major, cuBLAS's layout), row-major
    (the CPU quantizer's) or as a slice of rows of either: the same bits, pointer or TMA loads."""
    from jetrl.fp8 import kernel_weight_scale
    from jetrl.kernels import quantize_1x128, launch_fp8_gemm
    g = torch.Generator().manual_seed(4)
    M, K, N = 80, 384, 256                                             # 3 K blocks, two 64-row tiles (one partial)
    x_fp8 = quantize_1x128((torch.randn(M + 16, K, generator=g) * 3).to(torch.bfloat16).to(DEVICE))
    w = quantize_unchecked(torch.randn(N, K, generator=g) / 20, (128, 128))
    w_data, w_scale = w.data.to(DEVICE), kernel_weight_scale(w).to(DEVICE)
    assert_scales_column_major(x_fp8)
    data = x_fp8.data[:M]
    outs = []
    for scale in (x_fp8.scale[:M], x_fp8.scale[:M].contiguous(), x_fp8.scale.contiguous()[:M]):
        for tma in (False, True):
            out = torch.empty(M, N, device=DEVICE, dtype=torch.bfloat16)
            outs.append(launch_fp8_gemm(data, scale, w_data, w_scale, None, out, (64, 128, 4, 3, 1), tma=tma))
    assert all(same_bits(out, outs[0]) for out in outs[1:])
    want = FP8Tensor(data, x_fp8.scale[:M], (1, 128), "e4m3").dequantize().cpu() @ w.dequantize().t()
    assert ((outs[0].float().cpu() - want).norm() / want.norm()).item() < 1e-2


@needs_kernels
def test_quantize_128x128_reads_strided_weights(gpu_casts):
    "A transposed view and a view with a row stride past K (a slice of a fused weight): the same bytes as a copy."
    w = weight((300, 520), torch.bfloat16).to(DEVICE)
    for view in (w.t(), w[:, 100:400], w[::2]):
        assert_same_weight_fp8(quantize_128x128(view), view, "e4m3")


@needs_kernels
def test_quantize_128x128_writes_into_out_in_place(gpu_casts):
    """With `out` the bytes and scales go into its tensors, returned: their addresses kept (a captured CUDA graph reads
    them), their version counters moved (as an in-place op's). Also into the cropped view the CPU quantizer gives a
    ragged weight's data (rows strided past K). What the tensors held before does not leak into the result."""
    w = weight((200, 300), torch.bfloat16).to(DEVICE)
    stale = torch.full((200, 300), 7.0)
    cropped = quantize_unchecked(stale, (128, 128))                  # data: a (200, 300) view of the padded (256, 384)
    assert cropped.data.stride() == (384, 1)
    cropped = cropped._replace(data=cropped.data.to(DEVICE), scale=cropped.scale.to(DEVICE))   # (.to keeps the view on the CPU)
    for out in (quantize_128x128(stale.to(DEVICE)), cropped):
        addresses, versions = (out.data.data_ptr(), out.scale.data_ptr()), (out.data._version, out.scale._version)
        again = quantize_128x128(w, "e4m3", out=out)
        assert again is out and (out.data.data_ptr(), out.scale.data_ptr()) == addresses
        assert out.data._version > versions[0] and out.scale._version > versions[1]
        assert_same_weight_fp8(out, w, "e4m3")


def test_quantize_128x128_rejects_what_it_cannot_take():
    "A clear ValueError, before any kernel runs (so also where Triton is missing), for a non-2-D or non-float weight and an out that does not fit."
    with pytest.raises(ValueError, match="2-D weight"): quantize_128x128(torch.zeros(2, 128, 128))
    with pytest.raises(ValueError, match="2-D weight"): quantize_128x128(torch.zeros(128))
    with pytest.raises(ValueError, match="2-D weight"): quantize_128x128(torch.zeros(128, 128, dtype=torch.float64))
    with pytest.raises(ValueError, match="Unknown FP8 format"): quantize_128x128(torch.zeros(128, 128), "e3m4")
    w = torch.zeros(200, 300)
    good = FP8Tensor(torch.empty(200, 300, dtype=torch.float8_e4m3fn), torch.empty(2, 3), (128, 128), "e4m3")
    for bad in (good._replace(data=torch.empty(200, 301, dtype=torch.float8_e4m3fn)),    # another weight's shape
                good._replace(data=torch.empty(200, 300, dtype=torch.float8_e5m2)),      # another format's bytes
                good._replace(scale=torch.empty(2, 2)), good._replace(scale=torch.empty(2, 3, dtype=torch.float64)),
                good._replace(block=(1, 128)), good._replace(fmt="e5m2"),
                good._replace(data=torch.empty(200, 300, dtype=torch.float8_e4m3fn, device="meta"))):
        with pytest.raises(ValueError, match="out must have the layout"): quantize_128x128(w, "e4m3", out=bad)


@pytest.mark.skipif(invariant_kernels_available("cpu"), reason="Triton runs here (the interpreter)")
def test_quantize_128x128_needs_triton_on_the_cpu():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"): quantize_128x128(torch.zeros(128, 128))


# ---- attention: the query-invariant kernel against the fp32 oracle, decode against the trainer ----

def test_fp8_values_are_stored_dim_major_with_the_same_bytes():
    """`new_kv_codes(dim_major=True)`: a (b, heads, T, d) view of (b, heads, d, T padded to KV_COLUMN_ALIGN) storage.
    `quantize_kv_into` writes the same bytes there as into token-major codes (at the decode step's column and over a
    whole sequence), and the engine's FP8 cache and the trainer's `KVCodes.quantize` both store values that way."""
    from jetrl.kernels.attention import KV_COLUMN_ALIGN, KVCodes, new_kv_codes, quantize_kv, quantize_kv_into
    from jetrl.forward import StaticKVCache
    x = torch.randn(2, 3, 21, 16).to(DEVICE, torch.bfloat16)
    token, dim = new_kv_codes(2, 3, 40, 16, DEVICE), new_kv_codes(2, 3, 40, 16, DEVICE, dim_major=True)
    assert dim.shape == token.shape == (2, 3, 40, 16) and dim.stride()[2:] == (1, 48) and 48 % KV_COLUMN_ALIGN == 0
    columns = torch.arange(5, 26, device=DEVICE)
    for codes in (token, dim): quantize_kv_into(x, codes, torch.zeros(2, 3, 40, device=DEVICE), columns)
    assert torch.equal(token.view(torch.uint8), dim.view(torch.uint8)) and token.view(torch.uint8)[:, :, 5:26].any()
    one = new_kv_codes(2, 3, 40, 16, DEVICE, dim_major=True)            # decode: one token at its column
    quantize_kv_into(x[:, :, 7:8], one, torch.zeros(2, 3, 40, device=DEVICE), torch.tensor([30], device=DEVICE))
    assert torch.equal(one[:, :, 30].view(torch.uint8), token[:, :, 12].view(torch.uint8))
    codes = KVCodes.quantize(x, x)
    assert codes.k.stride(-1) == 1 and codes.v.stride(-2) == 1
    assert torch.equal(codes.v.view(torch.uint8), quantize_kv(x)[0].view(torch.uint8))
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=64))
    cache = StaticKVCache.allocate(model, rows=3, capacity=37, device=DEVICE, dtype=torch.bfloat16, kv_fp8=True)
    assert all(k.stride(-1) == 1 and v.stride(-2) == 1 and v.shape == (3, 2, 37, 16) for k, v in zip(cache.keys, cache.values))


ATTENTION_VS_FP32 = 2**-7   # of the largest |value|: p rounded to bf16 (2^-9 of each term) and the output's rounding


@needs_kernels
@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp8-values-token-major"])
def test_attention_kernel_equals_fp32_oracle_and_decode_equals_trainer(kv, gpu_casts, monkeypatch):
    """The kernel (BF16 keys and values; or FP8 ones, the products then in fp16, the values dim-major as
    `KVCodes.quantize` stores them or token-major) lies
    within ATTENTION_VS_FP32 of SDPA in fp32 over the same values (the exact codes x scales for FP8), ragged left
    padding and three key splits; and decode (heads as rows, splits in parallel, then merged) gives every column's
    query the trainer's bits. Splits and blocks made small for the interpreter: the same code paths."""
    from jetrl.kernels.attention import KVCodes, attend, attention_invariant, causal_key_mask, quantize_kv
    from jetrl.forward import first_valid_column
    monkeypatch.setattr(jetrl.kernels.attention, "KEY_SPLIT", 32)
    monkeypatch.setattr(jetrl.kernels.attention, "KEY_BLOCK", 16)
    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, T, D = 2, 4, 2, 3 * 32 + 5, 16
    q = torch.randn(b, heads, T, D, generator=g).to(DEVICE, torch.bfloat16)
    k, v = (torch.randn(b, kv_heads, T, D, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    valid = torch.ones(b, T, dtype=torch.bool, device=DEVICE); valid[1, :37] = False
    valid[0, 50:53] = False                 # a hole inside row 0's keys
    start, columns, scale = first_valid_column(valid), torch.arange(T, device=DEVICE), D ** -0.5
    codes = KVCodes.quantize(k, v) if kv.startswith("fp8") else None
    if kv == "fp8-values-token-major": codes = codes._replace(v=codes.v.contiguous())
    if codes is not None: assert codes.v.stride(-1 if kv == "fp8-values-token-major" else -2) == 1
    kk, vv = (None, None) if codes else (k, v)
    trainer = attend(q, kk, vv, columns, valid, scale, True, start, codes)
    k_exact, v_exact = codes.dequantize(torch.float32) if codes else (k.float(), v.float())
    want = F.scaled_dot_product_attention(q.float(), k_exact, v_exact, attn_mask=causal_key_mask(valid, columns),
                                          scale=scale, enable_gqa=True)
    err = (trainer.float() - want).abs().max() / v_exact.abs().max()
    assert err <= ATTENTION_VS_FP32, f"{kv}: {float(err):.2e} of the largest value from the fp32 oracle"
    # decode: the trainer's bits at every checked column (split edges, the padding's edge, the hole's)
    for c in [0, 36, 37, 31, 32, 49, 50, 53, 63, 64, 80, T - 1]:
        decode = attend(q[:, :, c:c + 1], kk, vv, columns[c:c + 1], valid, scale, True, start, codes)
        assert torch.equal(decode, trainer[:, :, c:c + 1]), f"{kv}: column {c}"


@needs_kernels
def test_fp8_kv_attention_takes_queries_beyond_fp16s_range(gpu_casts):
    """With FP8 keys and values the products are in fp16, whose range ends at 65504 where bf16's goes on: a query
    element beyond it is clamped to 65504, not turned into inf (which would make every score inf or NaN)."""
    from jetrl.kernels.attention import KVCodes, attend, quantize_kv
    g = torch.Generator().manual_seed(0)
    b, heads, T, D = 1, 2, 16, 16
    q = torch.randn(b, heads, T, D, generator=g).to(DEVICE, torch.bfloat16)
    q[0, 0, :, 0] = 1e5                                          # a bf16 value, past fp16's largest
    k, v = (torch.randn(b, 1, T, D, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    codes = KVCodes.quantize(k, v)
    valid, columns = torch.ones(b, T, dtype=torch.bool, device=DEVICE), torch.arange(T, device=DEVICE)
    out = attend(q, None, None, columns, valid, D ** -0.5, True, None, codes)
    assert torch.isfinite(out).all()
    clamped = attend(q.clamp(max=65504), None, None, columns, valid, D ** -0.5, True, None, codes)
    assert torch.equal(out, clamped)


@pytest.mark.parametrize("layout", ["heads-major", "token-major"])
def test_attention_backward_over_rows_moved_left_equals_the_masked_one(layout, monkeypatch):
    """`_attention_grads(one_run=True)` moves each row left to its first token and takes plain causal SDPA; in float64
    its dq, dk, dv equal the masked backward's (1e-10) for rows with left padding, right padding, both, none and no
    token at all, whichever layout q, k, v and d_out come in (the trainer's are token-major). A row moved by one column
    too few, or a pad seen as a key, changes them by far more (checked)."""
    from jetrl.kernels.attention import _attention_grads, rows_are_one_run
    import jetrl.kernels.attention as attention
    torch.manual_seed(0)
    b, T, D = 5, 12, 8
    valid = torch.ones(b, T, dtype=torch.bool)
    valid[0, :4] = False; valid[1, 9:] = False; valid[2, :2] = False; valid[2, 10:] = False; valid[4] = False
    assert rows_are_one_run(valid)
    holes = valid.clone(); holes[3, 5] = False
    assert not rows_are_one_run(holes)
    def tensor(heads):
        t = torch.randn(b, heads, T, D, dtype=torch.float64) if layout == "heads-major" else \
            torch.randn(b, T, heads, D, dtype=torch.float64).transpose(1, 2)
        return t.requires_grad_()
    q, k, v, d_out = tensor(4), tensor(2), tensor(2), tensor(4).detach()
    columns = torch.arange(T)
    masked = _attention_grads(q, k, v, columns, valid, D ** -0.5, d_out)
    moved = _attention_grads(q, k, v, columns, valid, D ** -0.5, d_out, one_run=True)
    for m, a in zip(masked, moved): torch.testing.assert_close(a, m, rtol=0, atol=1e-10)
    real_move = attention._move_columns
    monkeypatch.setattr(attention, "_move_columns", lambda x, index: real_move(x, (index - 1) % T))    # one column short
    wrong = _attention_grads(q, k, v, columns, valid, D ** -0.5, d_out, one_run=True)
    assert max((w - m).abs().max().item() for w, m in zip(wrong, masked)) > 1e-3
