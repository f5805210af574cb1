#!/usr/bin/env bash
# The tests and a GPT-2 124M run on a CUDA machine that reaches no package registry: what it
# lacks comes as wheels, downloaded on a machine that reaches PyPI, for its Python (3.12 here):
#   pip download --no-deps --python-version 3.12 --only-binary=:all: -d .whl312 \
#       coremltools cattrs pyaml 'mlx[cpu]==0.32.4' mlx-cpu==0.32.4 wandb pydantic ...
# usage: benchmarks/on_device.sh default|slow|gpt2 OUT_FOLDER
set -euo pipefail
what=$1
out=$2
# into the environment's own site-packages: the tests' subprocesses set their own PYTHONPATH
python3 -m pip install -q --no-index --no-deps .whl312/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,uuid --format=csv,noheader
python3 -c "import torch, mlx.core, coremltools, wandb; print('torch', torch.__version__)"
case $what in
  default) python3 -m pytest -q -n 8 -p no:cacheprovider 2>&1 | tail -25 ;;
  slow) python3 -m pytest -q -n 12 -m slow -p no:cacheprovider 2>&1 | tail -40 ;;
  gpt2)  # GPT-2 124M, both engines on the GPU (the ANE's fp16 stand-in beside autograd's bf16)
    python3 -m tools.fast_standin --mode hetero --device cuda --ane_device cuda \
      --ane_dtype float16 --max_iters 1000 --log_interval 10 --eval_interval 100 \
      --eval_iters 20 --sample_tokens 0 --patience 0 --out_dir /tmp/gpt2_hetero --quiet \
      > "$out/gpt2_hetero.log" 2>&1
    cp /tmp/gpt2_hetero/metrics.jsonl "$out/gpt2_hetero_metrics.jsonl"
    tail -3 "$out/gpt2_hetero.log" ;;
esac
