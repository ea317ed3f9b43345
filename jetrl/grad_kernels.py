"""`jetrl.grad_kernels` is another name of `jetrl.kernels.grad` (nbs/00k_grad_kernels.ipynb): import from there."""
import sys
from .kernels import grad as _module
sys.modules[__name__] = _module
