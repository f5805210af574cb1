#!/usr/bin/env bash
# On an H200: GPU-only, ANE-only and hetero, GPT-2 124M on Shakespeare, context 256,
# 200 steps of 8 x 256 x 4 tokens, half of each step's microbatches on the "ANE" in hetero
# (the eager derivation in fp16 on the same GPU, its own CUDA stream). FLAGS: the learning
# rate and anything else to add. SEED_GROUPS: seed lists, one tools.compare process each, placed on
# the machine's GPUs in turn; several share a GPU well, since at 2,048 tokens a microbatch
# each run is bound by kernel launches, not by the GPU (so their time axes are not a speed
# measurement). Each process stops after LIMIT seconds; the runs' metrics come back as one
# tar file (no checkpoints); `python -m tools.compare` with the same flags, --out_dir and the seeds
# that finished re-reads them and prints the table (each process writes its own table, of its
# seeds only, to the same summary.json: the re-read is the one of all the seeds). Each group
# needs 2 seeds or more; --max_iters stays 200 (the count of finished runs below reads it).
# The machine it assumes: one or more H200s, requirements.txt installed, data/shakespeare
# prepared; run from the repository's root. OUT: where the tar file goes (default: here).
set -uo pipefail
export PYTHONUNBUFFERED=1
DIR=${DIR:-out/compare_h200}
mkdir -p "$DIR"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
[[ $NGPU -ge 1 ]] || NGPU=1
k=0
for seeds in ${SEED_GROUPS:-1-3 4-6}; do
  CUDA_VISIBLE_DEVICES=$((k % NGPU)) timeout ${LIMIT:-400} python3 -m tools.compare --dataset shakespeare --seeds $seeds \
    --out_dir "$DIR" --drop_checkpoints --device cuda --block_size 256 --batch_size 8 --gradient_accumulation_steps 4 \
    --max_iters 200 --warmup_iters 20 --eval_interval 200 --eval_seconds 3 --log_interval 10 --ane_fraction 0.5 \
    ${FLAGS:---learning_rate 6e-4 --min_lr 6e-5} > "$DIR/log_$seeds.txt" 2>&1 &
  k=$((k + 1))
done
wait
for f in "$DIR"/log_*.txt; do echo "== $f"; grep -v Warning "$f" | tail -n 12; done
echo "finished runs: $(for f in "$DIR"/*/metrics.jsonl; do tail -n 1 "$f"; echo; done | grep -c '"step": 200,.*val_ppl')"
tar --exclude='ckpt.pt*' -czf ${OUT:-.}/compare_h200.tgz "$DIR"
