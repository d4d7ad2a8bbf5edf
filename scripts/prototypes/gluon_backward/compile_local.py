"""Compile gluon_bwd._bwd_kernel for sm_90a without a GPU and print regs / spills / shared memory.
usage: PYTHONPATH=/tmp/t36 python scripts/prototypes/gluon_backward/compile_local.py [--d 128,64] [--dump DIR]"""
import argparse, inspect, os, re, subprocess, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon import language as gl
import gluon_bwd as gb


R = 1

def compile_one(d, dump=None, **over):
    cfg = dict(gb.CONFIG[d], **over)
    const = {k: v for k, v in cfg.items()}
    const["HEAD_D"] = d
    const["R"] = R
    kern = gb._bwd_kernel
    params = list(inspect.signature(kern.fn).parameters)
    fake = torch.empty(1 << 16, d, dtype=torch.bfloat16)
    boxes = gb.block_shapes(d, cfg["BLOCK_M"])
    sig, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(params):
        if p in const:
            sig[p] = "constexpr"; constexprs[(i,)] = const[p]
        elif p.endswith("_desc"):
            box = boxes[{'dk': 'k', 'dv': 'v'}.get(p[:-5], p[:-5])]
            sig[p] = mangle_type(TensorDescriptor(fake, list(fake.shape), list(fake.stride()), box,
                                                  gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)))
        elif p in ("DQ", "Lse2", "Delta"):
            sig[p] = "*fp32"; attrs[(i,)] = [["tt.divisibility", 16]]
        elif p in ("DK", "DV"):
            sig[p] = "*bf16"; attrs[(i,)] = [["tt.divisibility", 16]]
        elif p in ("qk_scale", "sm_scale"):
            sig[p] = "fp32"
        else:
            sig[p] = "i32"
            if p in ("N", "W", "RB", "RH"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(GluonASTSource(kern, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg["num_warps"]))
    b = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    res = subprocess.run([b + "cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    sass = subprocess.run([b + "cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    pv = subprocess.run([b + "ptxas", "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"],
                        capture_output=True, text=True).stderr
    sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", pv)
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    if dump:
        os.makedirs(dump, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            open(os.path.join(dump, f"bwd_d{d}.{ext}"), "w").write(k.asm[ext])
        open(os.path.join(dump, f"bwd_d{d}.sass"), "w").write(sass)
    print(f"bwd R={R} D={d}: regs {m.group(1)} stack {m.group(2)} STL {len(re.findall(r'STL', sass))} "
          f"LDL {len(re.findall(r'LDL', sass))} shared {k.metadata.shared} HGMMA {len(re.findall('HGMMA', sass))} "
          f"RED {len(re.findall(r'RED', sass))} | {sp.group(0) if sp else '?'}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="128,64")
    ap.add_argument("--dump", default=None)
    ap.add_argument("--r", default="1,2")
    ap.add_argument("--pipe", default="0,1")
    ap.add_argument("--dqw", default="0,1")
    a = ap.parse_args()
    for R in map(int, a.r.split(",")):
      for d in map(int, a.d.split(",")):
       for pipe in map(int, a.pipe.split(",")):
        for dqw in map(int, a.dqw.split(",")):
         try:
            print(f'PIPE={pipe} DQW={dqw}', end=' ')
            compile_one(d, a.dump and f'{a.dump}/p{pipe}w{dqw}', PIPE=pipe, DQW=dqw)
         except Exception as e:
            import traceback; traceback.print_exc()
            print(f"D={d} FAILED: {type(e).__name__}: {str(e)[:3000]}", flush=True)
