"""The overlapped decode GEMM (`jetrl.kernels.decode_gemm`) where no GPU is: its switch and routing, its input checks, and
its compiled form. Triton's compiler runs on the CPU, so the property the kernel exists for, block k + 1's product
still running while block k is added (`WARPGROUP.DEPBAR.LE gsb0, 0x1` inside a chunk, where jetrl's Triton kernel
waits for every block), is checked on the machine code (SASS) it compiles to for an H100/H200 (sm_90). That test needs a Triton with Gluon
(skipped in CI, which has no Triton):

    python -m pytest -q tests/test_gluon_kernels.py        (Triton installed)

Its bits against the Triton kernel's, its speed and the engine == trainer gap with it are GPU tests
(`tests/test_gpu.py`, `test_gluon_decode_*`)."""
import re
import pytest
import torch

import jetrl.kernels.gemm
from jetrl.kernels.decode_gemm import (OverlappedTile, gluon_decode_possible, gluon_importable, hopper_sass,
                                       launch_decode_overlapped, overlapped_tile_for)
from jetrl.options import KernelOptions, use_kernel_options

needs_gluon = pytest.mark.skipif(not gluon_importable(), reason="needs a Triton with Gluon (Hopper's TMA and wgmma)")
WAIT = re.compile(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)")        # wait until at most that many wgmma groups run
FP8_WGMMA = re.compile(r"QGMMA\.64x(\d+)x32\.F32\.E4M3\.E4M3")


def _operands(M=4, K=128, N=8):
    a, w = torch.zeros(M, K, dtype=torch.float8_e4m3fn), torch.zeros(N, K, dtype=torch.float8_e4m3fn)
    return a, torch.ones(M, 1), w, torch.ones(1, 1), torch.empty(M, N, dtype=torch.bfloat16)


def test_on_for_decode_and_never_on_the_cpu():
    assert KernelOptions().gluon_decode is True
    a, a_scale, w, w_scale, out = _operands()
    assert not gluon_decode_possible(a, w, out)
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        launch_decode_overlapped(a, a_scale, w, w_scale, None, out)


H100_SMS = 132
LLAMA3_8B_64_ROWS = [(64, 4096, 6144, OverlappedTile(64, 32, 1, 8, 8)), (64, 4096, 4096, OverlappedTile()),   # q/k/v, output
                     (64, 14336, 4096, OverlappedTile()), (64, 4096, 28672, None)]                            # down, gate/up


@pytest.mark.parametrize("M, K, N, tile", LLAMA3_8B_64_ROWS + [
    (128, 3584, 4608, OverlappedTile(64, 128, 1, 4, 8)), (128, 3584, 3584, OverlappedTile(64, 64, 1, 8, 8)),  # Qwen2-7B, 128 rows
    (128, 18944, 3584, OverlappedTile(64, 64, 1, 8, 8)), (128, 3584, 37888, None),
    (256, 896, 896, OverlappedTile(64, 64, 1, 8, 8)), (256, 896, 9728, None),                                # Qwen2-0.5B, 256 rows
    (jetrl.kernels.gemm.DECODE_MAX_ROWS + 1, 18944, 3584, None)])                                            # past decode
def test_routing_takes_the_overlapped_kernel_where_its_grid_fits_one_wave(monkeypatch, M, K, N, tile):
    """`jetrl.kernels.gemm`'s FP8 GEMM op takes the overlapped kernel for a decode GEMM (<= DECODE_MAX_ROWS rows) with the
    tile `overlapped_tile_for` gives (32 columns for one row tile, 64 for several, 128 while the grid exceeds one wave
    of the GPU's SMs), the Triton kernel where it gives none, where the switch is off and where Gluon cannot run. The
    decode_gemm benchmark measured these choices (decode_gemm_h100.jsonl). Both launches are stubbed here (no GPU):
    the test records which one the op called, and with which tile."""
    gemm = jetrl.kernels.gemm
    calls = []
    monkeypatch.setattr(gemm, "sm_count", lambda device: H100_SMS)
    monkeypatch.setattr(gemm, "gluon_decode_possible", lambda a, w, out: True)
    monkeypatch.setattr(gemm, "launch_decode_overlapped", lambda *args: calls.append(("gluon", args[6])) or args[5])
    monkeypatch.setattr(gemm, "launch_fp8_gemm", lambda *args: calls.append(("triton", None)) or args[5])
    a, a_scale, w, w_scale, _ = _operands(M, K, N)
    out = gemm._fp8_gemm_invariant_op(a, a_scale, w, w_scale, None, torch.bfloat16)
    assert out.shape == (M, N) and calls == [("triton", None) if tile is None else ("gluon", tile)], calls
    for options, possible in ((KernelOptions(gluon_decode=False), True), (KernelOptions(), False)):   # off; no Hopper/Gluon
        monkeypatch.setattr(gemm, "gluon_decode_possible", lambda a, w, out: possible)
        calls.clear()
        with use_kernel_options(options):
            gemm._fp8_gemm_invariant_op(a, a_scale, w, w_scale, None, torch.bfloat16)
        assert calls == [("triton", None)], calls


def test_a_grid_past_one_wave_widens_the_tile_then_leaves_the_kernel():
    """The wave rule itself: the same GEMM on a GPU with fewer SMs gets a wider tile, then none."""
    assert overlapped_tile_for(64, 6144, 132) == OverlappedTile(64, 32, 1, 8, 8)     # 192 programs, 2 per SM
    assert overlapped_tile_for(64, 6144, 90) == OverlappedTile(64, 128, 1, 4, 8)     # 192 > 180, 96 > 90 at 64 columns
    assert overlapped_tile_for(64, 6144, 40) is None                                 # 48 programs of 128 columns > 40


@pytest.mark.parametrize("tile, rule", [(OverlappedTile(cols=48), "cols must be"), (OverlappedTile(cols=8), "cols must be"),
                                        (OverlappedTile(rows=96), "rows must be"), (OverlappedTile(unroll=3), "unroll must be even"),
                                        (OverlappedTile(unroll=0), "unroll must be even"),
                                        (OverlappedTile(unroll=8, stages=6), "stages must be"),
                                        (OverlappedTile(cols=16, col_groups=2), "each at least 16"),
                                        (OverlappedTile(rows=128, cols=64, col_groups=2), "at most 8 warps"),
                                        (OverlappedTile(rows=128, cols=64, stages=10, unroll=2), "shared memory")])
def test_bad_tiles_are_refused_with_the_rule(tile, rule):
    a, a_scale, w, w_scale, out = _operands()
    with pytest.raises(ValueError, match=rule):
        launch_decode_overlapped(a, a_scale, w, w_scale, None, out, tile)


@needs_gluon
@pytest.mark.parametrize("blocks, tile, has_bias", [(8, OverlappedTile(unroll=4, stages=6), False), (7, OverlappedTile(64, 16, 1, 2, 2), True),
                                                    (28, OverlappedTile(64, 64, 2, 4, 6), True), (1, OverlappedTile(), False),
                                                    (148, OverlappedTile(), False), (38, OverlappedTile(), True), (148, OverlappedTile(128, 64, 1, 8, 8), False),
                                                    (38, OverlappedTile(64, 32, 2, 4, 4), False),
                                                    (32, OverlappedTile(64, 128, 1, 4, 8), False), (112, OverlappedTile(64, 128, 2, 8, 8), True)])
def test_machine_code_keeps_one_product_running(blocks, tile, has_bias):
    """In the machine code for sm_90, compiled with a real launch's alignment hints, each K block's product is four FP8
    wgmma of K = 32 over a warp group's width (the Triton kernel's instruction), and inside a chunk of `unroll` blocks
    the wait after each block but the last leaves one product running (`0x1`): the overlap survived ptxas, which
    serializes every wgmma when running registers are copied or read (warnings C7514/C7515) or short (C7512). The Triton
    kernel waits for all (`0x0`) after every block. The code is the chunk loop's body, then the last `blocks % unroll`."""
    sass = hopper_sass(blocks, tile, has_bias)
    tail = blocks % tile.unroll
    width = str(tile.cols // tile.col_groups)
    assert FP8_WGMMA.findall(sass) == [width] * (4 * (tile.unroll + tail)), FP8_WGMMA.findall(sass)
    chunk = ["0x1"] * (tile.unroll - 1) + ["0x0"]
    assert WAIT.findall(sass) == chunk + (["0x1"] * (tail - 1) + ["0x0"] if tail else []), WAIT.findall(sass)
