#!/usr/bin/env bash
# The H200 measurements of issue 5 (and the one-GPU variant of issue 7), in one call:
#  A: autograd on CUDA (bf16) + the eager derivation on the 16 CPU cores (fp32)
#  B: autograd (bf16) + the eager derivation (fp16, the ANE's precision) on one GPU, two streams
# and nanoGPT's bench.py with biases (bias=True, GPT-2 as published) for issue 2's table.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -c "import tqdm" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
nproc
common="--bench --dataset shakespeare --device cuda --vocab_size 50304 --quiet"
echo "== A: CUDA + CPU"
python3 hetero_gpt.py $common --ane_device cpu --ane_dtype float32 --batch_size 1 --block_size 1024 \
    --gradient_accumulation_steps 16 --bench_iters 3
echo "== B: one GPU, two streams"
python3 hetero_gpt.py $common --ane_device cuda --ane_dtype float16 --batch_size 4 --block_size 1024 \
    --gradient_accumulation_steps 8 --bench_iters 5
echo "== nanoGPT bench.py with bias=True"
for d in float32 bfloat16; do
  (cd "${NANOGPT:-.bench/nanoGPT}" && python3 bench.py --real_data=False --dtype=$d --compile=False --bias=True | tail -1)
done
