"""Compile jetrl.kernels.grad's requantizer (both forms) for Hopper (sm_90) without a GPU, with the ptxas that ships in Triton's wheel,
and print each launch's registers and spills, and its machine code's instruction count and memory instructions (shared
and global loads and stores, by width: e.g. `U8x64` is 64 one-byte load instructions in the code). Arguments are specialized as
Triton's JIT does at the given shape (strides of 1 become constants, multiples of 16 get divisibility hints).

    python tools/grad_kernels_sm90.py                    # M=10240 tokens, K=3584, N=18944; every launch of the sweep
                                                         # (REQUANTIZE_CANDIDATES)
"""
import argparse, collections, itertools, os, subprocess, tempfile
import torch
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from jetrl.kernels import grad as gk

COMPILER_OPTIONS = ("num_warps", "num_stages", "maxnreg")                  # launch keys that go to the compiler
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", "e4m3": "*fp8e4nv", "e5m2": "*fp8e5"}


def ptxas_report(fn, args: dict, constants: dict, options: dict) -> str:
    "args: name -> (type, value at this shape); a value of 1 is specialized to a constant, multiples of 16 get /16 hints."
    signature, consts, attrs = {}, dict(constants), {}
    for i, (name, (kind, value)) in enumerate(args.items()):
        if value == 1: signature[name], consts[name] = "constexpr", 1
        else:
            signature[name] = kind
            if kind.startswith("*") or value % 16 == 0: attrs[(i,)] = [["tt.divisibility", 16]]
    signature.update({k: "constexpr" for k in constants})
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"]); f.flush()
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True).stderr
    report = " | ".join(line.split("info    :")[-1].strip() for line in out.splitlines() if "spill" in line or "registers" in line)
    return report + " | " + sass_counts(compiled.asm["cubin"])


def sass_counts(cubin: bytes) -> str:
    "The machine code's instruction count, and its float max/min instructions (FMNMX; .NAN: the NaN-keeping form)."
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin); f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    # an instruction line: /*0010*/  OPCODE ... ;  (.byte lines and labels are not instructions)
    # an opcode may follow a predicate (@P0, @!P1)
    ops = [next(w for w in line.split("*/", 1)[1].split() if not w.startswith("@")) for line in text.splitlines()
           if line.strip().startswith("/*") and line.rstrip().endswith(";") and "*/" in line]
    ops = [op for op in ops if op != ".byte"]
    memory_ops = lambda kind: ",".join(f"{op.split('.', 1)[-1] if '.' in op else '32'}x{n}"
                                   for op, n in sorted(collections.Counter(o for o in ops if o.split(".")[0] == kind).items()))
    return (f"{len(ops)} instructions, FMNMX {sum(op.startswith('FMNMX') for op in ops)} ({sum(op == 'FMNMX.NAN' for op in ops)} "
            f".NAN), shared stores {memory_ops('STS')}, loads {memory_ops('LDS')}; global stores {memory_ops('STG')}, "
            f"loads {memory_ops('LDG')}")


def qt_args(form: str, fp8_pointer: str, M: int) -> tuple[dict, dict]:
    "The transposed output's pointer and row stride: FP8 bytes, or for form 'quads' 32-bit words of four tokens."
    if form == "quads": return dict(qt_words_ptr=("*i32", 0)), dict(stride_qt_words=("i32", M // 4))
    return dict(qt_ptr=(fp8_pointer, 0)), dict(stride_qt=("i32", M))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="10240x3584x18944", help="MxKxN")
    p.add_argument("--forms", default="tile,quads", help="the kernel forms to compile (comma-separated)")
    p.add_argument("--formats", default="e4m3,e5m2")
    args = p.parse_args(argv)
    forms, formats = args.forms.split(","), args.formats.split(",")
    M, K, N = map(int, args.shape.split("x"))
    requantizes = gk.REQUANTIZE_FORMS
    def split(launch: dict, fmt: str):
        "(form, printed name, compiler options, the kernel's constexprs) of a launch."
        launch = dict(launch)
        form, name = launch.pop("form"), " ".join(f"{k}={v}" for k, v in launch.items() if k != "form")
        options = {k: launch.pop(k) for k in COMPILER_OPTIONS if k in launch}        # the rest are the kernel's constexprs
        return form, f"{form:6} {name:22}", options, dict(gk._fp8_constants(fmt), EXACT_ROUNDING=False, G=gk.KERNEL_BLOCK, **launch)
    # the 1x128 scales are column-major (jetrl.kernels.empty_scales_1x128): a row stride of 1, a column stride of the rows
    for launch, fmt, hp in itertools.product(gk.REQUANTIZE_CANDIDATES, formats, [torch.bfloat16, torch.float32]):
        form, name, options, constants = split(launch, fmt)
        if form not in forms: continue
        constants.setdefault("COLS", gk.KERNEL_BLOCK)
        if form == "quads": constants["QT_DTYPE"] = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}[fmt]
        q, grid = POINTER[fmt], gk._grid(hp)
        qt, stride_qt = qt_args(form, q, M)
        print(f"requantize {fmt} to {str(hp):14} {name}:", ptxas_report(requantizes[form], dict(
            q_ptr=(q, 0), s_ptr=("*fp32", 0), **qt, scale_t_ptr=("*fp32", 0), M=("i32", M), K=("i32", K),
            stride_q=("i32", K), stride_q_col=("i32", 1), stride_s=("i32", 1), stride_s_col=("i32", M),
            **stride_qt, stride_scale_t=("i32", 1), stride_scale_t_col=("i32", K)),
            dict(constants, HP_DTYPE=TL_DTYPES[hp], HP_MANTISSA=grid["MANTISSA"], HP_MIN_EXP=grid["MIN_EXP"], HP_MAX=grid["MAX"]),
            options))

if __name__ == "__main__":
    main()
