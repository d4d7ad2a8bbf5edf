"""CPU emulation of gluon_bwd._bwd_kernel's index math and tile algebra (float32), checked against autograd on
the gathered sets with run_gpu.py's gather/scatter helpers. usage: python emulate_cpu.py"""
import math
import torch
import run_gpu as rg

LOG2E = 1.4426950408889634


def emulate(q, k, v, out, do, lse, w, r, BLOCK_M=64, KEYS=64):
    B, H, N, D = q.shape
    scale = 1.0 / math.sqrt(D)
    lse2 = (lse * LOG2E).reshape(-1)
    delta = (do.float() * out.float()).sum(-1).reshape(-1)
    dq = torch.zeros(B * H * N, D)
    dk = torch.zeros(B * H * N, D)
    dv = torch.zeros(B * H * N, D)
    views = {n: x.float().reshape(B * H * N // r, r * D) for n, x in (("q", q), ("k", k), ("v", v), ("do", do))}
    RB, RH = H * N // r, N // r
    set_len = w // r
    for bh in range(B * H):
        b, h = bh // H, bh % H
        off = h % r
        for seg in range(N // w):
            member0 = b * RB + h * RH + seg * set_len
            col = off * D
            row0 = bh * N + seg * w + off
            for key_tile in range(set_len // 128):
                key_first = key_tile * 128
                kr = member0 + key_first
                K = [views["k"][kr + c * KEYS: kr + (c + 1) * KEYS, col:col + D] for c in range(2)]
                V = [views["v"][kr + c * KEYS: kr + (c + 1) * KEYS, col:col + D] for c in range(2)]
                KD = [views["k"][kr: kr + 128, col + c * D // 2: col + (c + 1) * D // 2] for c in range(2)]
                dK = [torch.zeros(KEYS, D) for _ in range(2)]
                dV = [torch.zeros(KEYS, D) for _ in range(2)]
                for t in range(set_len // BLOCK_M):
                    Q = views["q"][member0 + t * BLOCK_M: member0 + (t + 1) * BLOCK_M, col:col + D]
                    DO = views["do"][member0 + t * BLOCK_M: member0 + (t + 1) * BLOCK_M, col:col + D]
                    qrow = row0 + t * BLOCK_M * r
                    qidx = qrow + torch.arange(BLOCK_M) * r
                    dsT_all = torch.zeros(128, BLOCK_M)
                    for c in range(2):
                        sT = K[c] @ Q.T
                        pT = torch.exp2(sT * scale * LOG2E - lse2[qidx][None, :])
                        dpT = V[c] @ DO.T
                        dsT = pT * (dpT - delta[qidx][None, :])
                        dsT_all[c * KEYS:(c + 1) * KEYS] = dsT
                        dV[c] += pT @ DO
                        dK[c] += dsT @ Q
                    for c in range(2):
                        dq[qidx, c * D // 2:(c + 1) * D // 2] += scale * (dsT_all.T @ KD[c])
                for c in range(2):
                    rows = row0 + (key_first + c * KEYS + torch.arange(KEYS)) * r
                    dk[rows] = dK[c] * scale
                    dv[rows] = dV[c]
    return dq.view(B, H, N, D), dk.view(B, H, N, D), dv.view(B, H, N, D)


if __name__ == "__main__":
    torch.manual_seed(0)
    B, H, N, D = 1, 2, 1024, 64
    for (w, r) in ((256, 1), (512, 2)):
        q, k, v, do = (torch.randn(B, H, N, D) for _ in range(4))
        scale = 1.0 / math.sqrt(D)
        qg, kg, vg = (rg.gather_sets(x, w, r).requires_grad_(True) for x in (q, k, v))
        dog = rg.gather_sets(do, w, r)
        s = qg @ kg.transpose(-1, -2) * scale
        og = torch.softmax(s, -1) @ vg
        ref = [rg.scatter_sets(g, q.shape, w, r) for g in torch.autograd.grad(og, (qg, kg, vg), dog)]
        out = rg.scatter_sets(og.detach(), q.shape, w, r)
        lse = rg.scatter_sets(torch.logsumexp(s, -1).detach(), q.shape, w, r)
        assert torch.equal(rg.scatter_sets(rg.gather_sets(q, w, r), q.shape, w, r)[:, :, :, :].ne(0).any(-1).sum(), torch.tensor(B * H * N // r))
        got = emulate(q, k, v, out, do, lse, w, r)
        print((w, r), [f"{((x - y).norm() / y.norm()).item():.2e}" for x, y in zip(got, ref)])
