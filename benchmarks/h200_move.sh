#!/usr/bin/env bash
# On an H200: the GPU engine and the stand-in of this tree against those of an earlier one
# (BEFORE: a copy of it, e.g. `git archive <commit> | tar -x -C .bench/before`), side by side
# in one call: bench.py of each in turn, ROUNDS times (before, after, before, after...), the
# fast stand-in with fused kernels on the same GPU, GPT-2 124M, 8 microbatches of 4 x 1024.
set -uo pipefail
export PYTHONUNBUFFERED=1
root=$(pwd)
before=${BEFORE:-.bench/before}
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__)"
# the CUDA tests of the stand-in first (the CUDA graph on its own stream, each attention kernel)
python3 -m pytest -q -p no:cacheprovider tests/test_standin.py -k "not without_standin" 2>&1 | tail -n 3
common="--dataset shakespeare --data_dir $root/data --device cuda --quiet --ane_device cuda --ane_dtype float16
        --batch_size 4 --block_size 1024 --gradient_accumulation_steps 8 --fused_kernels
        --bench_iters ${ITERS:-8} --bench_repeats ${REPEATS:-2}"
for r in $(seq ${ROUNDS:-2}); do
  echo "== round $r: before"
  (cd "$before" && timeout ${LIMIT:-140} python3 bench.py $common --out_dir "$root/.bench/out_before") | tail -n 5
  echo "== round $r: after"
  timeout ${LIMIT:-140} python3 bench.py $common --fast --out_dir "$root/.bench/out_after" | tail -n 5
done
