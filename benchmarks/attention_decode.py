"""Decode attention at the long-rollout shape: jetrl's kernel (BF16 and FP8 keys/values) per tile setting, against the
bytes bound and PyTorch's fastest dense attention, with the decode == trainer bit check.

    python -m benchmarks attention_decode --out benchmarks/results/attention_decode_h200.jsonl

One decode step of one layer of the llama3-8b shape (32 query heads over 8 key/value heads, head_dim 128): --rows rows,
ragged prompts of --prompt-min..--prompt-max tokens left-padded to the longest, the query --generated tokens past it,
in a cache of the long rollout's capacity. Per tile setting (KEY_BLOCK, KEY_SPLIT, warps, stages and the FP8 path's
register bound of `jetrl.kernels.attention`; each `--tiles` entry is `block:split:warps:stages:fp8_registers`, 0 for
unbounded registers), one row: the kernel's GPU time with BF16 and with FP8 keys/values (FP8 values dim-major, as the
engine's cache and `KVCodes.quantize` store them; and token-major, the keys' layout, `fp8_values_token_major_us`) (CUDA graphs replayed, no host time), each against its bound (the written keys and values
of every row, FP8 with their fp32 scales, at the GPU's memory bandwidth: `hbm_bytes_per_s`), and `decode_equals_trainer`: every checked column's decode
output equals the trainer kernel's, BF16 and FP8 (block, split and warps change the bits of both sides together).
Once: SDPA's cuDNN/flash kernels over dense keys of the mean written length (no mask, no padding): what the fastest
general attention reads those bytes in.
"""
import argparse, contextlib
import torch
import torch.nn.functional as F

import jetrl.kernels.attention as attention
from benchmarks.common import add_output_args, emit, hbm_bytes_per_s, make_row, need_cuda
from jetrl.forward import first_valid_column
from jetrl.kernels.support import graph_time_ms

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
TILE_NAMES = ("KEY_BLOCK", "KEY_SPLIT", "ATTENTION_WARPS", "ATTENTION_STAGES", "FP8_KV_MAX_REGISTERS")
# the default sweep: the tiles in use, then the settings still open, the untimed first (two warps, or 128-key blocks on
# four, whose FP8 tiles compile to fewer instructions a key without spilling when their registers are unbounded: 24.8
# and 25.8 warp-instructions a key against 32.6: attention_resources_sm90.txt), then longer splits. Each tile compiles
# its kernels anew: on one H100 three tiles took most of 110 s
TILES = "64:512:4:3:128,64:512:2:3:0,128:512:4:3:0,64:1024:2:3:0,64:1024:4:3:128,64:2048:4:3:128"


def tile_settings(text: str) -> list[dict]:
    settings = []
    for entry in text.split(","):
        parts = entry.split(":")
        if len(parts) != 5 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"--tiles: {entry!r} is not block:split:warps:stages:fp8_registers (five whole numbers, "
                             "e.g. 64:512:4:3:128; registers 0: unbounded)")
        settings.append(dict(zip(TILE_NAMES, map(int, parts))))
    return settings


def current_tiles() -> dict:
    "The attention's tile constants as `jetrl.kernels.attention` holds them now."
    return {n: getattr(attention, n) for n in TILE_NAMES}


@contextlib.contextmanager
def attention_tiles(tiles: dict):
    "Run the block with `jetrl.kernels.attention`'s tile constants set to `tiles` (both sides read them at each call), then restore them."
    chosen = current_tiles()
    try:
        for n, value in tiles.items(): setattr(attention, n, value)
        yield
    finally:
        for n, value in chosen.items(): setattr(attention, n, value)


def decode_equals_trainer(device) -> bool:
    "Ragged rows, three splits: the decode kernel's output at a set of columns equals the trainer kernel's, BF16 and FP8 (both value layouts)."
    g = torch.Generator().manual_seed(1)
    T = 3 * attention.KEY_SPLIT + 77
    q = torch.randn(4, 8, T, HEAD_DIM, generator=g).to(device, torch.bfloat16)
    k, v = (torch.randn(4, 2, T, HEAD_DIM, generator=g).to(device, torch.bfloat16) for _ in range(2))
    valid = torch.ones(4, T, dtype=torch.bool, device=device)
    for row, pads in enumerate([0, 37, attention.KEY_SPLIT + 5, 900]): valid[row, :pads] = False
    start, columns = first_valid_column(valid), torch.arange(T, device=device)
    codes = attention.KVCodes.quantize(k, v)
    checked = sorted({*range(0, T, 97), T - 1, *(s * attention.KEY_SPLIT + d for s in (1, 2) for d in (-1, 0))})
    for kk, vv, cc in ((k, v, None), (None, None, codes), (None, None, codes._replace(v=codes.v.contiguous()))):
        trainer = attention.attend(q, kk, vv, columns, valid, HEAD_DIM ** -0.5, True, start, cc)
        for c in checked:
            decode = attention.attend(q[:, :, c:c + 1], kk, vv, columns[c:c + 1], valid, HEAD_DIM ** -0.5, True, start, cc)
            if not torch.equal(decode, trainer[:, :, c:c + 1]): return False
    return True


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks attention_decode", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt-min", type=int, default=100)
    p.add_argument("--prompt-max", type=int, default=1000)
    p.add_argument("--generated", type=int, default=1600, help="tokens generated so far (the query's distance past the prompts)")
    p.add_argument("--capacity", type=int, default=1000 + 4096, help="the cache's columns (the long rollout's)")
    p.add_argument("--tiles", type=tile_settings, default=tile_settings(TILES), metavar="BLOCK:SPLIT:WARPS:STAGES:FP8_REGISTERS,...")
    add_output_args(p, kernels=False)
    args = p.parse_args(argv)
    need_cuda("attention_decode")
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (args.rows,), generator=g)
    longest, column = int(lengths.max()), int(lengths.max()) + args.generated
    if column >= args.capacity: raise SystemExit(f"--capacity {args.capacity} must exceed the query's column {column}")
    valid = torch.zeros(args.rows, args.capacity, dtype=torch.bool)
    for r, n in enumerate(lengths.tolist()): valid[r, longest - n:column + 1] = True
    valid = valid.to(device)
    start, q_column = first_valid_column(valid), torch.tensor([column], device=device)
    keys = int(valid.sum())                                         # written keys, every row
    q = torch.randn(args.rows, HEADS, 1, HEAD_DIM, generator=g).to(device, torch.bfloat16)
    k, v = (torch.randn(args.rows, KV_HEADS, args.capacity, HEAD_DIM, generator=g).to(device, torch.bfloat16) for _ in range(2))
    codes = attention.KVCodes.quantize(k, v)
    token_major = codes._replace(v=codes.v.contiguous())                # FP8 values laid out as the keys are
    bandwidth, bandwidth_source = hbm_bytes_per_s(device)
    bound_us = {kv: 1e6 * keys * KV_HEADS * 2 * per / bandwidth for kv, per in
                (("bf16", HEAD_DIM * 2), ("fp8", HEAD_DIM + 4))}
    scale = HEAD_DIM ** -0.5
    shape = dict(rows=args.rows, prompt_tokens_mean=float(lengths.float().mean()), generated=args.generated,
                 keys_mean=keys / args.rows, hbm_tb_per_s=bandwidth / 1e12, bandwidth_source=bandwidth_source,
                 bf16_bound_us=bound_us["bf16"], fp8_bound_us=bound_us["fp8"])
    dense = keys // args.rows
    qd, kd, vd = q.clone(), k[:, :, :dense].contiguous(), v[:, :, :dense].contiguous()
    from torch.nn.attention import sdpa_kernel, SDPBackend
    sdpa = {}
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        try:
            with sdpa_kernel(backend):
                sdpa[backend.name.lower()] = 1e3 * graph_time_ms(
                    lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True))
        except RuntimeError as e: print(f"SDPA {backend.name}: not run ({str(e)[:80]})")
    best = min(sdpa.items(), key=lambda kv: kv[1]) if sdpa else (None, float("nan"))
    emit(make_row("attention_decode", shape | dict(kernel=f"sdpa_{best[0]}_dense", bf16_us=best[1],
                                                   bf16_over_bound=best[1] / bound_us["bf16"]), argv, device), args.out)
    chosen = current_tiles()
    for tiles in args.tiles:
        with attention_tiles(tiles):
            t = {kv: 1e3 * graph_time_ms(lambda: attention.attend(q, kk, vv, q_column, valid, scale, True, start, cc))
                 for kv, kk, vv, cc in (("bf16", k, v, None), ("fp8", None, None, codes),
                                        ("fp8_values_token_major", None, None, token_major))}
            emit(make_row("attention_decode", shape | dict(
                kernel="jetrl", key_block=tiles["KEY_BLOCK"], key_split=tiles["KEY_SPLIT"],
                warps=tiles["ATTENTION_WARPS"], stages=tiles["ATTENTION_STAGES"],
                fp8_max_registers=tiles["FP8_KV_MAX_REGISTERS"] or None,
                default=tiles == chosen,
                bf16_us=t["bf16"], fp8_us=t["fp8"], fp8_values_token_major_us=t["fp8_values_token_major"],
                bf16_over_bound=t["bf16"] / bound_us["bf16"],
                fp8_over_bound=t["fp8"] / bound_us["fp8"], fp8_over_bf16=t["fp8"] / t["bf16"],
                decode_equals_trainer=decode_equals_trainer(device)), argv, device), args.out)


if __name__ == "__main__":
    main()
