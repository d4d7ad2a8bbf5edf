"""One forward of the issue-4 configuration per order, for Nsight Compute to profile.

    ncu --clock-control none --kernel-name regex:_fwd_kernel --section ... \
        python scripts/ncu_forward.py

Launches, in order: the Hilbert order's four branch kernels ((2048,1) ... (16384,8)), then the
identity order's four.
"""
import torch

from lowering import dilated_attention

W, R = [2048, 4096, 8192, 16384], [1, 2, 4, 8]
q, k, v = (torch.randn(1, 16, 65536, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
with torch.no_grad():
    for hilbert in (True, False):
        dilated_attention(q, k, v, W, R, hilbert=hilbert, lowering="triton")
    torch.cuda.synchronize()
