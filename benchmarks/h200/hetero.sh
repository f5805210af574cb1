#!/usr/bin/env bash
# Hetero on H200s: `python bench.py` (gpu, ane and hetero side by side)
#  A: autograd on CUDA (bf16) + the eager derivation on the 16 CPU cores (fp32)
#  B: autograd (bf16) + the eager derivation (fp16, the ANE's precision) on one GPU, two streams
#  C (needs 2 GPUs): the same as B with the eager engine on the second GPU
# CASES="A B" (default) picks which to run; CASES=C on the 2 x H200 machine (SPLITS: the
# microbatch shapes it benches; CURVE=0 skips its 50-step loss comparison).
# The machine it assumes: one H200 (two for C) with 16 CPU cores a GPU, requirements.txt and
# pytest installed, data/shakespeare prepared; run from the repository's root.
set -uo pipefail
export PYTHONUNBUFFERED=1
nproc
common="--dataset shakespeare --device cuda --quiet"
if [[ " ${CASES:-A B} " == *" A "* ]]; then
  echo "== A: CUDA + CPU, GPT-2 124M"
  timeout 170 python3 bench.py $common --ane_device cpu --ane_dtype float32 --batch_size 1 --block_size 1024 \
      --gradient_accumulation_steps 4 --bench_iters 8
fi
if [[ " ${CASES:-A B} " == *" B "* ]]; then
  echo "== B: one GPU, two streams, GPT-2 124M"
  timeout 150 python3 bench.py $common --ane_device cuda --ane_dtype float16 --batch_size 4 --block_size 1024 \
      --gradient_accumulation_steps 8
fi
if [[ " ${CASES:-A B} " == *" C "* ]]; then
  echo "== C: two GPUs, GPT-2 124M"
  nvidia-smi -L; nvidia-smi topo -m
  # the CUDA tests first (a CUDA graph of the eager step, an engine on the second GPU)
  python3 -m pytest -q -p no:cacheprovider tests/test_standin.py -k "not without_standin" 2>&1 | tail -n 5
  # the same 32768 tokens a step as 4 x 8 and as 2 x 16 microbatches: the split is a whole
  # number of microbatches, so finer ones let it come closer to the engines' speed ratio
  for bxa in ${SPLITS:-4x8 2x16}; do
    timeout 200 python3 bench.py $common --device cuda:0 --ane_device cuda:1 --ane_dtype float16 \
        --batch_size ${bxa%x*} --block_size 1024 --gradient_accumulation_steps ${bxa#*x} --bench_iters 10
  done
  # the split's convergence and the loss curve against GPU-only, step by step (same seed, same batches)
  [[ "${CURVE:-1}" == 1 ]] && for mode in gpu hetero; do
    timeout 200 python3 hetero_gpt.py --dataset shakespeare --device cuda:0 --ane_device cuda:1 --mode $mode \
        --batch_size 4 --block_size 1024 --gradient_accumulation_steps 8 --max_iters 50 --warmup_iters 10 \
        --log_interval 1 --eval_interval 50 --sample_tokens 0 --quiet --out_dir out/two_gpu_$mode > /dev/null
  done
  [[ "${CURVE:-1}" == 1 ]] && python3 - <<'PY'
import json
rows = {m: [json.loads(l) for l in open(f'out/two_gpu_{m}/metrics.jsonl')] for m in ('gpu', 'hetero')}
print('step  gpu loss  hetero loss  (its gpu / ane engine)  ANE microbatches  dropped')
for g, h in zip(rows['gpu'], rows['hetero']):
    if 'loss' in g and 'loss' in h:
        print(f"{g['step']:4d}  {g['loss']:8.4f}  {h['loss']:11.4f}  ({h.get('gpu_loss', float('nan')):.4f} / "
              f"{h.get('ane_loss', float('nan')):.4f})  {h['ane_microbatches']}/{h['microbatches']}  {h['dropped']}")
d = [abs(g['loss'] - h['loss']) / g['loss'] for g, h in zip(rows['gpu'], rows['hetero']) if 'loss' in g and 'loss' in h]
print(f"hetero vs gpu loss, relative difference: max {max(d):.4f}, mean {sum(d) / len(d):.4f} over {len(d)} steps")
PY
fi
