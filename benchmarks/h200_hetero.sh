#!/usr/bin/env bash
# Issue 5 (and the one-GPU variant of issue 7) on the H200: `python hetero_gpt.py --bench`
#  A: autograd on CUDA (bf16) + the eager derivation on the 16 CPU cores (fp32)
#  B: autograd (bf16) + the eager derivation (fp16, the ANE's precision) on one GPU, two streams
# CASES="A B" (default) picks which to run.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -c "import tqdm" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
nproc
common="--bench --dataset shakespeare --device cuda --quiet"
if [[ " ${CASES:-A B} " == *" A "* ]]; then
  echo "== A: CUDA + CPU, GPT-2 124M"
  timeout 170 python3 hetero_gpt.py $common --ane_device cpu --ane_dtype float32 --batch_size 1 --block_size 1024 \
      --gradient_accumulation_steps 4 --bench_iters 8
fi
if [[ " ${CASES:-A B} " == *" B "* ]]; then
  echo "== B: one GPU, two streams, GPT-2 124M"
  timeout 150 python3 hetero_gpt.py $common --ane_device cuda --ane_dtype float16 --batch_size 4 --block_size 1024 \
      --gradient_accumulation_steps 8 --bench_iters 10
fi
