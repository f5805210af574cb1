#!/usr/bin/env bash
# On an H200: the GPU engine and the stand-in of this tree against those of other trees, side
# by side in one call: bench.py of each tree in turn (TREES: copies of them, e.g. `git archive
# <commit> | tar -x -C .bench/before`; "." is this one), ROUNDS times; the stand-in with fused
# kernels on the same GPU (old trees: on CUDA by default; this one: --fast), GPT-2 124M,
# 8 microbatches of 4 x 1024 a step. TESTS=1 runs the stand-in's CUDA tests first.
# The machine it assumes: one H200, requirements.txt and pytest installed, data/shakespeare
# prepared; run from the repository's root.
set -uo pipefail
export PYTHONUNBUFFERED=1
root=$(pwd)
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__)"
[[ ${TESTS:-1} == 1 ]] && python3 -m pytest -q -p no:cacheprovider tests/test_standin.py -k "not without_standin" 2>&1 | tail -n 3
common="--dataset shakespeare --data_dir $root/data --device cuda --quiet --ane_device cuda --ane_dtype float16
        --batch_size 4 --block_size 1024 --gradient_accumulation_steps 8 --fused_kernels
        --bench_iters ${ITERS:-8} --bench_repeats ${REPEATS:-2}"
for r in $(seq ${ROUNDS:-2}); do
  for tree in ${TREES:-.bench/before .}; do
    fast=$(grep -q -- "'fast'\|fast: bool" "$tree/bench.py" && echo --fast)
    echo "== round $r: $tree"
    (cd "$tree" && timeout ${LIMIT:-140} python3 bench.py $common $fast --out_dir "$root/.bench/out") | tail -n 5
  done
done
