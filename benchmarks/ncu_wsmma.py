"""Profile input for Nsight Compute: wsmma.py (experimental) at M = 16 on one layer shape, launched 5 times.

    ncu --kernel-name regex:_wsmma_kernel --launch-skip 2 --launch-count 1 ... \
        python3 benchmarks/ncu_wsmma.py N K [CONS STAGES K_STEPS MAXNREG]
"""
import sys

import torch

from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm
from fp4ptq.kernels import wsmma

g = torch.Generator(device="cuda").manual_seed(0)
n, k = int(sys.argv[1]), int(sys.argv[2])
cfg = tuple(int(v) for v in sys.argv[3:7]) or None
wq = nvfp4.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02)
_, _, words, sbits, enc = gm._weight_views(wq)
x = torch.randn(16, k, device="cuda", generator=g).bfloat16()
y = torch.empty(16, n, device="cuda", dtype=torch.bfloat16)
for _ in range(5):
    wsmma.matmul(x, words, sbits, enc, None, None, y, cfg)
torch.cuda.synchronize()
print("ok", cfg or wsmma.config(16, n, k))
