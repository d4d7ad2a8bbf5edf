#!/bin/bash
# The training step of a 12-layer Llama (width 1024, 16 heads, bf16 autocast, AdamW, batch 1;
# examples/train_long_gpt.py) with the dilated backend against dense attention (backend="inductor",
# SDPA told is_causal: FlashAttention), at several lengths. Both backends of a case train in one
# process, one after the other on the same GPU, so that their ratio does not mix machines or runs.
#
#   OUT=out bash scripts/train_sweep.sh                        # all cases, 12 steps each
#   OUT=out CASES="32k 64k" STEPS=12 bash scripts/train_sweep.sh
#
# Cases: 32k, 64k, 128k (the example's branches (2048,1), (4096,2), ..., (32768,16), both backends);
# sparse32k (two branches, (2048,1) and (32768,16), dilated only: compare with the 32k case's dense).
# The step time is the median of the steps after the third. Each case writes $OUT/<case>/log.txt
# and train_long_gpt.json and prints the example's summary. CASE_TIMEOUT (300 s) bounds a case.
# EXTRA="..." is appended to every case's arguments; a CPU smoke test of this script:
#   EXTRA="--device cpu --layers 1 --width 64 --heads 4 --seq-len 256 --segment-lengths 32 256 --dilation-rates 1 4"
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton, transformers as t; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', t.__version__)"
A="python examples/train_long_gpt.py --steps ${STEPS:-12} --compare-steps ${STEPS:-12} --log-every 5"
rc=0
for c in ${CASES:-32k 64k 128k sparse32k}; do
  case $c in
    32k) args="--seq-len 32768" ;;
    64k) args="--seq-len 65536" ;;
    128k) args="--seq-len 131072" ;;
    sparse32k) args="--seq-len 32768 --segment-lengths 2048 32768 --dilation-rates 1 16 --backends hilbert_dilated" ;;
    *) echo "unknown case $c (32k 64k 128k sparse32k)"; rc=1; continue ;;
  esac
  mkdir -p "$OUT/$c"
  echo "=== $c: $args"
  start=$(date +%s)
  timeout ${CASE_TIMEOUT:-300} $A $args ${EXTRA:-} --out "$OUT/$c" > "$OUT/$c/log.txt" 2>&1
  status=$?
  [ $status -eq 0 ] || rc=1
  echo "rc $status in $(( $(date +%s) - start )) s"
  grep -A20 '^backend ' "$OUT/$c/log.txt" || tail -5 "$OUT/$c/log.txt"
done
exit $rc
