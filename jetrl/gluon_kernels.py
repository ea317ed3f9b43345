"""`jetrl.gluon_kernels` is another name of `jetrl.kernels.decode_gemm` (nbs/00d_decode_gemm.ipynb): import from there."""
import sys
from .kernels import decode_gemm as _module
sys.modules[__name__] = _module
