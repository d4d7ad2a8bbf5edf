#!/bin/bash
# The op on one GPU: the correctness check against the float64 reference, then the benchmark runs
# whose numbers BENCHMARKS.md gives. GPU, torch and triton versions are printed first.
#
#   OUT=out bash scripts/kernel_bench.sh                          # STEPS="check main"
#   OUT=out ROUNDS=5 STEPS="hilbert causal d64 scale" bash scripts/kernel_bench.sh
#
# Every benchmark step: bf16, B=1, H=16, D=128, branches (2048,1), (4096,2), (8192,4), (16384,8),
# Hilbert order on unless the step says otherwise. STEPS, run in the order given:
#   check    scripts/gpu_check.py --lowerings $LOWERINGS (default triton) in float32, bfloat16 and
#            float16, the three in parallel so that their kernel compiles overlap
#   main     N = 16K and 64K, forward and forward+backward: floor, triton, sdpa, dense, flex (flex
#            to 16K only: it is 30x slower); writes the table and plot of README.md
#   scale    forward, N = 16K to 1M: floor and triton (time per token)
#   hilbert  N = 64K, forward and forward+backward, Hilbert order on, then off
#   causal   N = 64K causal, the Hopper kernels on (HILBERT_FX_GLUON=1), then off (Triton kernels)
#   d64      head dim 64, N = 64K, forward
#   masks    N = 16K, forward and forward+backward, floor and triton: a boolean mask, an additive
#            one, dropout 0.1 (D = 128), then a boolean mask and dropout at D = 64, and dropout at
#            D = 64, causal, N = 32K, branches to (32768,16), identity order
# ROUNDS=R times every method R times in turn and reports medians: under its power limit the GPU
# lowers its clocks for stretches of time, so one timing per method meets whatever the moment has.
# Each step writes under $OUT/<step>/ (bench.md, bench.csv, bench.png; check: gpu_check.txt).
# Exits non-zero if a correctness case fails or a step fails or runs out of time.
export PYTHONPATH=.:tests PYTHONUNBUFFERED=1
OUT=${OUT:-out}
STEPS=${STEPS:-"check main"}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
B="python3 -m hilbert_fx.bench --segment-lengths 2048 4096 8192 16384 --dilation-rates 1 2 4 8 --heads 16 --head-dim 128 --dtype bfloat16 --rounds ${ROUNDS:-1}"
rc=0
bench() {  # bench DIR SECONDS ARGS...: one benchmark run, its table printed
  local dir=$1 limit=$2; shift 2
  mkdir -p "$dir"
  timeout "$limit" $B "$@" --out "$dir" > "$dir/log.txt" 2>&1 || { echo "FAILED (rc $?): $B $*"; tail -5 "$dir/log.txt"; rc=1; }
  cat "$dir/bench.md" 2>/dev/null
}
for s in $STEPS; do
  echo "=== step $s"
  case $s in
    check) pids=()
       for t in float32 bfloat16 float16; do
         mkdir -p "$OUT/check/$t"
         timeout 480 python3 scripts/gpu_check.py --lowerings ${LOWERINGS:-triton} --dtypes $t \
           --out "$OUT/check/$t" > "$OUT/check/$t/log.txt" 2>&1 & pids+=($!)
       done
       for p in "${pids[@]}"; do wait "$p" || rc=1; done
       cat "$OUT"/check/{float32,bfloat16,float16}/log.txt ;;
    main) bench "$OUT/main" 540 --seq-lens 16384 65536 --mode both --methods floor triton sdpa dense flex --max-len flex=16384 ;;
    scale) bench "$OUT/scale" 300 --seq-lens 16384 65536 262144 1048576 --mode fwd --methods floor triton ;;
    hilbert) for h in hilbert no-hilbert; do
         echo "--$h"; bench "$OUT/hilbert/$h" 120 --$h --seq-lens 65536 --mode both --methods triton floor; done ;;
    causal) for g in 1 0; do
         echo "HILBERT_FX_GLUON=$g"; HILBERT_FX_GLUON=$g bench "$OUT/causal/gluon$g" 150 --causal --seq-lens 65536 --mode both --methods triton floor; done ;;
    d64) bench "$OUT/d64" 120 --head-dim 64 --seq-lens 65536 --mode fwd --methods floor triton ;;
    masks) M="--seq-lens 16384 --mode both --methods floor triton"
       bench "$OUT/masks/bool" 150 $M --mask bool
       bench "$OUT/masks/float" 150 $M --mask float
       bench "$OUT/masks/dropout" 150 $M --dropout 0.1
       bench "$OUT/masks/bool64" 150 $M --mask bool --head-dim 64
       bench "$OUT/masks/dropout64" 150 $M --dropout 0.1 --head-dim 64
       bench "$OUT/masks/dropout64c" 150 --segment-lengths 2048 4096 8192 16384 32768 \
         --dilation-rates 1 2 4 8 16 --seq-lens 32768 --causal --no-hilbert --head-dim 64 \
         --dropout 0.1 --mode both --methods floor triton ;;
    *) echo "unknown step $s (check main scale hilbert causal d64 masks)"; rc=1 ;;
  esac
done
exit $rc
