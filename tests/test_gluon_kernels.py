"""The overlapped decode GEMM (`jetrl.gluon_kernels`) where no GPU is: its switch and routing, its input checks, and
its compiled form. Triton's compiler runs on the CPU, so the property the kernel exists for, block k + 1's product
still running while block k is added (`wgmma.wait_group 1` in the K loop, where jetrl's Triton kernel waits for
every block), is checked on the PTX it compiles to for an H100/H200 (sm_90). That test needs a Triton with Gluon
(skipped in CI, which has no Triton):

    PYTHONPATH=$PWD /work/venvs/triton/bin/python -m pytest -q tests/test_gluon_kernels.py

Its bits against the Triton kernel's, its speed and the engine == trainer gap with it are GPU tests
(`tests/test_gpu.py`, `test_gluon_decode_*`)."""
import re
import pytest
import torch

import jetrl.kernels
from jetrl.gluon_kernels import (GLUON_DECODE_STAGES, gluon_decode_possible, gluon_importable, hopper_ptx,
                                 launch_decode_overlapped, overlapped_decode_block_n)

needs_gluon = pytest.mark.skipif(not gluon_importable(), reason="needs a Triton with Gluon (Hopper's TMA and wgmma)")
WAIT = re.compile(r"wgmma\.wait_group\.sync\.aligned (\d+);")
WGMMA_FP8 = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.e4m3\.e4m3")


def _operands(M=4, K=128, N=8):
    a, w = torch.zeros(M, K, dtype=torch.float8_e4m3fn), torch.zeros(N, K, dtype=torch.float8_e4m3fn)
    return a, torch.ones(M, 1), w, torch.ones(1, 1), torch.empty(M, N, dtype=torch.bfloat16)


def test_off_by_default_and_never_on_the_cpu():
    assert jetrl.kernels.gluon_decode is False
    a, a_scale, w, w_scale, out = _operands()
    assert not gluon_decode_possible(a, w, out)
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        launch_decode_overlapped(a, a_scale, w, w_scale, None, out)


@pytest.mark.parametrize("block_n, stages", [(48, 4), (256, 4), (8, 4), (64, 1)])
def test_bad_tiles_are_refused_with_the_rule(block_n, stages):
    a, a_scale, w, w_scale, out = _operands()
    with pytest.raises(ValueError, match="block_n must divide 128"):
        launch_decode_overlapped(a, a_scale, w, w_scale, None, out, block_n, stages)


def test_tile_width_follows_the_weight_width():
    assert [overlapped_decode_block_n(n) for n in (128, 896, 1024, 1152, 2048, 3584, 37888)] == [16, 16, 16, 32, 32, 64, 64]


@needs_gluon
@pytest.mark.parametrize("block_n, stages, has_bias", [(64, GLUON_DECODE_STAGES, False), (16, 2, True), (128, 4, False)])
def test_compiled_loop_keeps_one_product_in_flight(block_n, stages, has_bias):
    """The K loop waits with one product outstanding (`wait_group 1`), and only the last block waits for all (`0`);
    each K block is four E4M3 wgmma of K = 32 over the tile's width (the Triton kernel's instruction), once in the
    first block's issue and once in the loop."""
    ptx = hopper_ptx(block_n, stages, has_bias)
    assert WAIT.findall(ptx) == ["1", "0"], WAIT.findall(ptx)
    assert WGMMA_FP8.findall(ptx) == [str(block_n)] * 8, WGMMA_FP8.findall(ptx)
