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
from jetrl.gluon_kernels import (GLUON_DECODE_STAGES, gluon_decode_possible, gluon_importable, hopper_sass,
                                 launch_decode_overlapped, overlapped_decode_block_n)

needs_gluon = pytest.mark.skipif(not gluon_importable(), reason="needs a Triton with Gluon (Hopper's TMA and wgmma)")
WAIT = re.compile(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)")        # wait until at most that many wgmma groups run
FP8_WGMMA = re.compile(r"QGMMA\.64x(\d+)x32\.F32\.E4M3\.E4M3")


def _operands(M=4, K=128, N=8):
    a, w = torch.zeros(M, K, dtype=torch.float8_e4m3fn), torch.zeros(N, K, dtype=torch.float8_e4m3fn)
    return a, torch.ones(M, 1), w, torch.ones(1, 1), torch.empty(M, N, dtype=torch.bfloat16)


def test_off_by_default_and_never_on_the_cpu():
    assert jetrl.kernels.gluon_decode is False
    a, a_scale, w, w_scale, out = _operands()
    assert not gluon_decode_possible(a, w, out)
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        launch_decode_overlapped(a, a_scale, w, w_scale, None, out)


@pytest.mark.parametrize("block_n, stages", [(48, 4), (64, 4), (8, 4), (32, 1)])
def test_bad_tiles_are_refused_with_the_rule(block_n, stages):
    a, a_scale, w, w_scale, out = _operands()
    with pytest.raises(ValueError, match="block_n must be one of"):
        launch_decode_overlapped(a, a_scale, w, w_scale, None, out, block_n, stages)


def test_tile_width_follows_the_weight_width():
    assert [overlapped_decode_block_n(n) for n in (128, 896, 1024, 1152, 2048, 3584, 37888)] == [16, 16, 16, 32, 32, 32, 32]


@needs_gluon
@pytest.mark.parametrize("blocks, block_n, stages, has_bias", [(8, 32, GLUON_DECODE_STAGES, False), (7, 16, 2, True),
                                                               (28, 32, GLUON_DECODE_STAGES, True), (1, 32, 3, False),
                                                               (148, 32, GLUON_DECODE_STAGES, False)])   # 7B down: ~40 s
def test_machine_code_keeps_one_product_running(blocks, block_n, stages, has_bias):
    """In the machine code for sm_90, compiled with a real launch's alignment hints, each K block's product is four FP8
    wgmma of K = 32 over the tile's width (the Triton kernel's instruction), and the wait after each block but the last
    leaves one product running (`0x1`): the overlap survived ptxas, which serializes wgmma when their running registers
    are copied (warning C7514) or short (C7512). The Triton kernel waits for all (`0x0`) after every block."""
    sass = hopper_sass(blocks, block_n, stages, has_bias)
    assert FP8_WGMMA.findall(sass) == [str(block_n)] * (4 * blocks), FP8_WGMMA.findall(sass)
    assert WAIT.findall(sass) == ["0x1"] * (blocks - 1) + ["0x0"], WAIT.findall(sass)
