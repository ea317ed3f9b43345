"""jetrl against an independent implementation: torchao 0.18's float8 training (`convert_to_float8_training`,
`emulate=True` so it runs on CPU), on the same weights and inputs, for the two recipes both libraries have.

How the recipes line up (torchao/float8/config.py, `Float8LinearConfig.from_recipe_name`):
* torchao "tensorwise": E4M3 x and W, but **E5M2** dy (the default target of `cast_config_grad_output`), exact
  amax/max scales. jetrl's "tensorwise" uses E4M3 dy, so we compare with `grad_fmt="e5m2"`.
* torchao "rowwise": E4M3 everywhere, scales rounded to powers of two (`round_scales_to_power_of_2=True`); jetrl's
  "rowwise" has exact scales, so we compare with `pow2_scale=True`.
* torchao multiplies by max/amax (computed in float64, rounded to fp32); jetrl divides by amax/max (fp32). The two
  scales can differ by one fp32 ulp and flip a rounding now and then; with power-of-two scales both are exact.
* torchao's Wgrad quantizes the high-precision x; jetrl re-quantizes x from the FP8 copy it saved in the forward.
  With tensorwise or power-of-two scales the re-quantization is (almost always) the identity, so dW still agrees;
  we also run torchao on x_saved = dequant(Q(x)), where the two Wgrads see the same operand by construction.

Measured (`pytest -q tests/test_torchao_crosscheck.py -s`; numbers printed by the tests), jetrl vs torchao:
* rowwise (pow2 scales): y and dx bit-identical, dW 141-144 dB (fp32 summation order only).
* tensorwise (exact scales): 135-142 dB on most shapes; on the 512x384x256 case dx and dW are 73.7 dB: one E5M2
  value of dy rounds the other way (the one-ulp scale difference above), which moves dx and dW alike.
* either library against fp32: 24.6-28.8 dB. The quantizers agree byte for byte with pow2 scales, and in all
  but 0-2 values in 10^6 with exact scales.
So we assert 100 dB with pow2 scales (nothing but fp32 summation order can differ) and 60 dB with exact scales (a
few flipped FP8 roundings in 10^5 values), both far above FP8-vs-fp32 (< 30 dB).
"""
import copy, logging
from dataclasses import replace
import pytest
import torch
import torch.nn as nn

for _name in ("torchao", "torch.utils._pytree"): logging.getLogger(_name).setLevel(logging.ERROR)
torchao = pytest.importorskip("torchao")
from torchao.float8 import convert_to_float8_training, Float8LinearConfig
from torchao.float8.config import ScalingGranularity
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import LinearMMConfig

from jetrl.fp8 import quantize, sqnr
from jetrl.linear import RECIPES, FP8Linear

AGREE_DB = {"rowwise": 100, "tensorwise": 60}     # jetrl vs torchao; see the docstring for what we measured
PAIRS = {             # torchao recipe name -> the jetrl recipe with the same arithmetic
    "tensorwise": replace(RECIPES["tensorwise"], name="tensorwise-e5m2-grad", grad_fmt="e5m2"),
    "rowwise": replace(RECIPES["rowwise"], name="rowwise-pow2", pow2_scale=True),
}
SHAPES = {"aligned": (512, 384, 256, None), "partial": (300, 200, 136, None), "3d": (100, 200, 136, (3,))}

def torchao_linear(linear: nn.Linear, recipe: str) -> nn.Module:
    config = replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    model = convert_to_float8_training(nn.Sequential(copy.deepcopy(linear)), config=config)
    assert type(model[0]).__name__ == "Float8Linear"
    return model

def run(module, weight_of, x, dy):
    "(y, dx, dW, dbias) of one forward and backward."
    xi = x.clone().requires_grad_()
    y = module(xi); y.backward(dy)
    lin = weight_of(module)
    return y.detach(), xi.grad, lin.weight.grad, lin.bias.grad

def setup(shape, seed, dtype=torch.float32):
    M, K, N, batch = SHAPES[shape]
    torch.manual_seed(seed)
    linear = nn.Linear(K, N, dtype=dtype)
    x = torch.randn(*(batch or ()), M, K, dtype=dtype)
    dy = torch.randn(*(batch or ()), M, N, dtype=dtype)
    return linear, x, dy

@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("ao_recipe", list(PAIRS))
def test_linear_matches_torchao(ao_recipe, shape):
    linear, x, dy = setup(shape, seed=0)
    ao = run(torchao_linear(linear, ao_recipe), lambda m: m[0], x, dy)
    jet = run(FP8Linear.from_linear(copy.deepcopy(linear), PAIRS[ao_recipe]), lambda m: m, x, dy)
    hp = run(copy.deepcopy(linear), lambda m: m, x, dy)
    agree = [sqnr(a, j) for a, j in zip(ao, jet)]
    vs_fp32 = [sqnr(h, j) for h, j in zip(hp, jet)]
    print(f"\n{ao_recipe:10} {shape:8} jetrl vs torchao (y, dx, dW, db): {[round(s, 1) for s in agree]} dB;"
          f" jetrl vs fp32: {[round(s, 1) for s in vs_fp32]} dB")
    assert all(s > AGREE_DB[ao_recipe] for s in agree), agree
    assert all(s < 35 for s in vs_fp32[:3])      # both really are FP8: the agreement is not two fp32 layers agreeing

@pytest.mark.parametrize("ao_recipe", list(PAIRS))
def test_wgrad_same_saved_x(ao_recipe):
    "Feed torchao the FP8-rounded x that jetrl saves: both Wgrads now quantize the same x (and the forward is unchanged)."
    linear, x, dy = setup("partial", seed=1)
    recipe = PAIRS[ao_recipe]
    x_saved = quantize(x, recipe.block("x", "fprop"), recipe.act_fmt, recipe.pow2_scale).dequantize()
    ao = run(torchao_linear(linear, ao_recipe), lambda m: m[0], x_saved, dy)
    jet = run(FP8Linear.from_linear(copy.deepcopy(linear), recipe), lambda m: m, x, dy)
    agree = [sqnr(a, j) for a, j in zip(ao, jet)]
    print(f"\n{ao_recipe:10} torchao on x_saved vs jetrl (y, dx, dW, db): {[round(s, 1) for s in agree]} dB")
    assert all(s > AGREE_DB[ao_recipe] for s in agree), agree

@pytest.mark.parametrize("ao_recipe", list(PAIRS))
def test_bf16_matches_torchao(ao_recipe):
    "bf16 module and activations: outputs rounded to bf16 by both, so agreement is at bf16's level (~2^-9: 50+ dB)."
    linear, x, dy = setup("partial", seed=2, dtype=torch.bfloat16)
    ao = run(torchao_linear(linear, ao_recipe), lambda m: m[0], x, dy)
    jet = run(FP8Linear.from_linear(copy.deepcopy(linear), PAIRS[ao_recipe]), lambda m: m, x, dy)
    agree = [sqnr(a, j) for a, j in zip(ao, jet)]
    print(f"\n{ao_recipe:10} bf16 jetrl vs torchao (y, dx, dW, db): {[round(s, 1) for s in agree]} dB")
    # a one-ulp bf16 difference in a few outputs is ~50 dB; anything FP8-sized would be < 35 dB
    assert all(s > 45 for s in agree), agree


# ---- the quantizers, byte for byte ---------------------------------------------------------------------------------

GRANULARITIES = {   # jetrl block -> torchao (granularity, axiswise_dim)
    None: (ScalingGranularity.TENSORWISE, None),
    (1, -1): (ScalingGranularity.AXISWISE, -1),
    (-1, 1): (ScalingGranularity.AXISWISE, 0),
}

@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("block", list(GRANULARITIES), ids=str)
def test_quantizer_matches_torchao(block, pow2, fmt):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(512, 512, generator=g) * torch.exp(torch.randn(512, 512, generator=g))
    gran, dim = GRANULARITIES[block]
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    ao = hp_tensor_to_float8_dynamic(x, dtype, LinearMMConfig(), scaling_granularity=gran, axiswise_dim=dim,
                                     round_scales_to_power_of_2=pow2)
    jet = quantize(x, block, fmt, pow2)
    ao_scale = (1 / ao._scale.double()).reshape(jet.scale.shape)      # torchao stores fp8_max / amax
    ao_bytes, jet_bytes = ao._data.view(torch.uint8), jet.data.view(torch.uint8)
    if pow2:
        # powers of two: the reciprocal is exact, so scales and bytes are identical
        assert torch.equal(ao_scale.float(), jet.scale) and torch.equal(ao_bytes, jet_bytes)
    else:
        # fp32(max/amax) vs fp32(amax/max): at most one fp32 ulp apart (plus the reciprocal's rounding)
        assert ((ao_scale - jet.scale.double()).abs() <= 2 * 2**-23 * jet.scale.double()).all()
        differ = ao_bytes != jet_bytes
        # such a scale difference can flip a value lying within an ulp of a rounding midpoint: measured 0-2 in 10^6
        assert differ.float().mean() < 1e-4
        # and a flip moves to the neighbouring FP8 code, never further (same sign, codes one apart)
        assert ((ao_bytes[differ].int() - jet_bytes[differ].int()).abs() == 1).all()
