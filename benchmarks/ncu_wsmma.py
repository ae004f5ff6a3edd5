import torch, sys
sys.path.insert(0, ".")
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm, wsmma
g = torch.Generator(device="cuda").manual_seed(0)
n, k = int(sys.argv[1]), int(sys.argv[2])
wq = nvfp4.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02)
_, _, words, sbits, enc = gm._weight_views(wq)
x = torch.randn(16, k, device="cuda", generator=g).bfloat16()
y = torch.empty(16, n, device="cuda", dtype=torch.bfloat16)
for _ in range(5):
    wsmma.matmul(x, words, sbits, enc, None, None, y)
torch.cuda.synchronize()
print("ok")
