"""Registers, spills and main-loop instructions of jetrl's attention kernel (decode and trainer specializations, BF16 and
FP8 keys/values, FP8 values token- or dim-major), compiled for sm_90 on the CPU by Triton's own compiler and read with
its bundled cuobjdump/nvdisasm. Run: PYTHONPATH=$PWD python resources.py"""
import collections, re, subprocess, tempfile, triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import jetrl.kernels.attention as A

CAPACITY = 5104     # the long rollout's 5,096 columns, padded as new_kv_codes pads dim-major codes

def build(kv_fp8, decode=True, maxnreg=None, values_dim_major=False):
    kv, sc = ("*fp8e4nv", "*fp32") if kv_fp8 else ("*bf16", "*i8")
    out = "*fp32" if decode else "*bf16"
    sig = dict(q_ptr="*bf16", k_ptr=kv, v_ptr=kv, ks_ptr=sc, vs_ptr=sc, o_ptr=out, m_ptr="*fp32" if decode else "*i8",
               l_ptr="*fp32" if decode else "*i8", q_col_ptr="*i32", valid_ptr="*i8", start_ptr="*i32")
    C = CAPACITY   # Llama-3-8B heads (32 query, 8 KV, head_dim 128)
    ints = dict(sq_b=4096, sq_h=128, sq_t=128, sk_b=8*C*128, sk_h=C*128, sk_t=128, sv_b=8*C*128, sv_h=C*128,
                sv_t=1 if values_dim_major else 128, sv_d=C if values_dim_major else 1, ss_b=8*C, ss_h=C,
                so_b=32*10*128, so_h=10*128, so_t=128, s_valid=C, sw_b=320, sw_h=10, sw_s=1, heads=32, group=4,
                Tq=1 if decode else 4096, Tk=C)
    sig |= {k: "i32" for k in ints} | {"scale": "fp32"}
    const = dict(HEADS_AS_ROWS=decode, SPLITS_IN_PARALLEL=decode, KV_FP8=kv_fp8, BLOCK_Q=A.QUERY_TILE, BLOCK_KV=A.KEY_BLOCK,
                 SPLIT_BLOCKS=A.KEY_SPLIT // A.KEY_BLOCK, D=128)
    sig |= {k: "constexpr" for k in const}
    names = list(sig)
    constexprs = {(names.index(k),): v for k, v in const.items()} | {(names.index(k),): 1 for k, v in ints.items() if v == 1}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n].startswith("*") or (n in ints and ints[n] % 16 == 0 and ints[n] != 1)}
    opts = dict(num_warps=A.ATTENTION_WARPS, num_stages=A.ATTENTION_STAGES, enable_fp_fusion=False) | ({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(ASTSource(A.attention_kernel, sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)

def loop_bodies(sass):
    "each backward branch's loop body (its SASS lines), in code order"
    lines = sass.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", l))}
    bodies = []
    for i, l in enumerate(lines):
        m = re.search(r"BRA\s+(?:`\()?(\.L_x_\d+)", l)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            body = lines[labels[m.group(1)]:i + 1]
            if len(re.findall(r"/\*[0-9a-f]{4}\*/", "\n".join(body))) > 1: bodies.append(body)
    return bodies

def report(name, k):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        sass = subprocess.run([knobs.nvidia.nvdisasm.path, "-c", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", res).group(1), re.search(r"STACK:(\d+)", res).group(1)
    bodies = loop_bodies(sass)
    sizes = [len(re.findall(r"/\*[0-9a-f]{4}\*/", "\n".join(b))) for b in bodies]
    ops = collections.Counter(m.group(1).split(".")[0] for l in bodies[0]
                              if (m := re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", l)))
    top = ", ".join(f"{op} {n}" for op, n in ops.most_common(6))
    print(f"{name:44s} registers {regs:>3}  spilled bytes {stack:>3}  key-block loops {sizes}; first loop: {top}")

print(f"triton {triton.__version__}; tiles: {A.KEY_BLOCK}-key blocks, {A.KEY_SPLIT}-key splits, {A.ATTENTION_WARPS} warps, "
      f"{A.ATTENTION_STAGES} stages; FP8_KV_MAX_REGISTERS = {A.FP8_KV_MAX_REGISTERS}; FP8 products in fp16")
report("decode, BF16 keys/values", build(False))
for dim_major in (False, True):
    layout = "values dim-major" if dim_major else "values token-major"
    report(f"decode, FP8, {layout}, unbounded", build(True, values_dim_major=dim_major))
    report(f"decode, FP8, {layout}, at {A.FP8_KV_MAX_REGISTERS}", build(True, maxnreg=A.FP8_KV_MAX_REGISTERS, values_dim_major=dim_major))
    report(f"decode, FP8, {layout}, at 168", build(True, maxnreg=168, values_dim_major=dim_major))
report("trainer, BF16 keys/values", build(False, decode=False))
report("trainer, FP8, values token-major", build(True, decode=False))
report("trainer, FP8, values dim-major", build(True, decode=False, values_dim_major=True))
