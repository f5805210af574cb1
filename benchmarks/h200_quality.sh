#!/usr/bin/env bash
# Issue 6 on the H200: GPU-only, ANE-only and hetero, 4 seeds, GPT-2 124M on Shakespeare
# (context 256 to fit the lease). The "ANE" is the eager derivation in fp16 on the same GPU
# (its own CUDA stream). The run folders come back as one tar file; compare.py re-reads them.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -c "import tqdm" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
python3 compare.py --dataset shakespeare --seeds ${SEEDS:-4} --out_dir out/compare --device cuda \
  --block_size 256 --batch_size 8 --gradient_accumulation_steps 4 --max_iters 250 \
  --learning_rate 6e-4 --min_lr 6e-5 --warmup_iters 25 --eval_interval 25 --eval_seconds 2 --log_interval 5
tar -czf ${OUT:-.}/compare_runs.tgz out/compare
