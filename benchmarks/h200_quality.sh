#!/usr/bin/env bash
# Issue 6 on the H200: GPU-only, ANE-only and hetero, SEEDS seeds (default 5), GPT-2 124M on
# Shakespeare, context 256, 200 steps of 8 x 256 x 4 tokens. The "ANE" is the eager
# derivation in fp16 on the same GPU (its own CUDA stream). The runs' metrics come back as
# one tar file (checkpoints left out); `python compare.py` with the same flags and
# --out_dir re-reads them (finished runs are reused) and prints the same table.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -c "import tqdm" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
timeout ${LIMIT:-400} python3 compare.py --dataset shakespeare --seeds ${SEEDS:-5} --out_dir out/compare_h200 --device cuda \
  --block_size 256 --batch_size 8 --gradient_accumulation_steps 4 --max_iters 200 \
  --learning_rate 6e-4 --min_lr 6e-5 --warmup_iters 20 --eval_interval 100 --eval_seconds 1 --log_interval 10
tar --exclude='ckpt.pt*' -czf ${OUT:-.}/compare_h200.tgz out/compare_h200
