import sys, re, subprocess, tempfile, collections
sys.argv=[sys.argv[0]]
exec(open('.scratch_dev/resources.py').read().split('print(f"triton')[0])
from triton import knobs
import os
fp8 = os.environ.get("FP8") == "1"
k = build(fp8, maxnreg=128 if fp8 else None, values_dim_major=fp8)
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(k.asm["cubin"]); f.flush()
    sass = subprocess.run([knobs.nvidia.nvdisasm.path, "-c", f.name], capture_output=True, text=True).stdout
b = loop_bodies(sass)[0]
print("\n".join(l for l in b if re.search(r"/\*[0-9a-f]{4}\*/", l)))
