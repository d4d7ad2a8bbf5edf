#!/bin/bash
# One device call for issue 4: the Triton lowering against the float64 reference, then the benchmark.
#   bash scripts/gpu_issue4.sh   (OUT must be set; STEPS picks parts: check main scale hilbert causal d64 sweep;
#   ROUNDS=3 times every method three times in turn and reports medians)
export PYTHONPATH=.:tests PYTHONUNBUFFERED=1
STEPS=${STEPS:-"check main"}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
B="python3 -m hilbert_fx.bench --segment-lengths 2048 4096 8192 16384 --dilation-rates 1 2 4 8 --heads 16 --head-dim 128 --dtype bfloat16 --rounds ${ROUNDS:-1}"
for s in $STEPS; do
  echo "=== step $s"
  case $s in
    check) for t in float32 bfloat16 float16; do  # the three dtypes compile in parallel
         mkdir -p $OUT/$t; timeout 480 python3 scripts/gpu_check.py --lowerings triton --dtypes $t --out $OUT/$t > /tmp/$t.log 2>&1 & done; wait
       cat /tmp/float32.log /tmp/bfloat16.log /tmp/float16.log ;;
    main) timeout 540 $B --seq-lens 16384 65536 --mode both --methods floor triton sdpa dense flex --max-len flex=16384 --out $OUT ;;
    scale) mkdir -p /tmp/scale; timeout 300 $B --seq-lens 16384 65536 262144 1048576 --mode fwd --methods floor triton --out /tmp/scale; cat /tmp/scale/bench.md ;;
    hilbert) mkdir -p /tmp/h; for h in --hilbert --no-hilbert; do timeout 120 $B $h --seq-lens 65536 --mode both --methods triton floor --out /tmp/h; cat /tmp/h/bench.md; done ;;
    causal) mkdir -p /tmp/c; for g in 1 0; do echo "HILBERT_FX_GLUON=$g"; HILBERT_FX_GLUON=$g timeout 150 $B --causal --seq-lens 65536 --mode both --methods triton floor --out /tmp/c > /dev/null 2>&1; cat /tmp/c/bench.md; done ;;
    d64) mkdir -p /tmp/d64; timeout 120 $B --head-dim 64 --seq-lens 65536 --mode fwd --methods floor triton --out /tmp/d64; cat /tmp/d64/bench.md ;;
    sweep)  # tile configurations of the Triton kernels at N = 64K (BLOCK_M,BLOCK_N,warps,stages)
       for c in 128,64,4,3 128,64,8,3 128,128,8,2 64,64,4,3 128,32,4,4; do
         echo "fwd $c: $(HILBERT_FX_TRITON_FWD=$c timeout 60 $B --seq-lens 65536 --mode fwd --methods triton --out /tmp/sw 2>/dev/null | grep '^ *65536')"; done
       for c in 64,128,8,2 64,64,4,3 128,128,8,2 32,64,4,3; do
         echo "dkdv $c: $(HILBERT_FX_TRITON_DKDV=$c timeout 60 $B --seq-lens 65536 --mode fwdbwd --methods triton --out /tmp/sw 2>/dev/null | grep '^ *65536')"; done
       for c in 128,64,8,2 64,64,4,3 64,32,4,3; do
         echo "dq $c: $(HILBERT_FX_TRITON_DQ=$c timeout 60 $B --seq-lens 65536 --mode fwdbwd --methods triton --out /tmp/sw 2>/dev/null | grep '^ *65536')"; done
       echo "atomic dq: $(HILBERT_FX_TRITON_ATOMIC_DQ=1 timeout 60 $B --seq-lens 65536 --mode fwdbwd --methods triton --out /tmp/sw 2>/dev/null | grep '^ *65536')" ;;
  esac
done
