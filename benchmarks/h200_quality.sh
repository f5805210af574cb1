#!/usr/bin/env bash
# Issue 6 on the H200: GPU-only, ANE-only and hetero, GPT-2 124M on Shakespeare, context 256,
# 200 steps of 8 x 256 x 4 tokens. The "ANE" is the eager derivation in fp16 on the same GPU
# (its own CUDA stream). One comparison, its seeds shared over the machine's GPUs: SEEDS_0 on
# GPU 0 and, where there is a second GPU, SEEDS_1 on GPU 1, each inside LIMIT seconds. The
# runs' metrics come back as one tar file (checkpoints left out); `python compare.py` with
# the same flags, --out_dir and the seeds that finished re-reads them and prints the table.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -c "import tqdm" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
mkdir -p out/compare_h200
one() {  # GPU index, seeds
  CUDA_VISIBLE_DEVICES=$1 timeout ${LIMIT:-400} python3 compare.py --dataset shakespeare --seeds $2 \
    --out_dir out/compare_h200 --device cuda --block_size 256 --batch_size 8 --gradient_accumulation_steps 4 \
    --max_iters 200 --learning_rate 6e-4 --min_lr 6e-5 --warmup_iters 20 --eval_interval 100 --eval_seconds 2 \
    --log_interval 10 > out/quality_gpu$1.log 2>&1
}
one 0 "${SEEDS_0:-1-3}" &
[[ $(nvidia-smi -L | wc -l) -ge 2 ]] && one 1 "${SEEDS_1:-4-6}" &
wait
for f in out/quality_gpu*.log; do echo "== $f"; grep -v Warning "$f" | tail -n 14; done
grep -l '"val_ppl"' out/compare_h200/*/metrics.jsonl | wc -l
tar --exclude='ckpt.pt*' -czf ${OUT:-.}/compare_h200.tgz out/compare_h200 out/quality_gpu*.log
