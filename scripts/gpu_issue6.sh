#!/bin/bash
# One device call for issue 6: the 12-layer Llama's training step, dilated against fair dense
# (SDPA is_causal), at several lengths and dilated configurations, each pair in the same run.
#   CASES="32k 64k 128k sparse32k" STEPS=12 bash scripts/gpu_issue6.sh   (OUT must be set)
#   EXTRA="..." appends arguments to every case (a CPU smoke test: EXTRA="--device cpu --layers 1 --width 64 --heads 4 --seq-len 256 --segment-lengths 32 256 --dilation-rates 1 4")
# Each case writes $OUT/<case>/log.txt and train_long_gpt.json; the summary lines are printed.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton, transformers as t; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', t.__version__)"
A="python examples/train_long_gpt.py --steps ${STEPS:-12} --compare-steps ${STEPS:-12} --log-every 5"
for c in ${CASES:-32k 64k 128k sparse32k}; do
  case $c in
    32k) args="--seq-len 32768" ;;
    64k) args="--seq-len 65536" ;;
    128k) args="--seq-len 131072" ;;
    sparse32k) args="--seq-len 32768 --segment-lengths 2048 32768 --dilation-rates 1 16 --backends hilbert_dilated" ;;
    *) echo "unknown case $c (32k 64k 128k sparse32k)"; continue ;;
  esac
  mkdir -p $OUT/$c
  echo "=== $c: $args"
  start=$(date +%s)
  timeout ${CASE_TIMEOUT:-300} $A $args ${EXTRA:-} --out $OUT/$c > $OUT/$c/log.txt 2>&1
  echo "rc $? in $(( $(date +%s) - start )) s"
  grep -A20 '^backend ' $OUT/$c/log.txt || tail -5 $OUT/$c/log.txt
done
