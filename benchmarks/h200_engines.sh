#!/usr/bin/env bash
# On an H200: ours vs nanoGPT's bench.py (PARTS=nano), and the hand-derived step vs
# autograd (PARTS=manual). Both need more than one 10-minute call together: run
# them as two. NANOGPT: a checkout of karpathy/nanoGPT (not in this repo). NANO_ARGS: more
# flags for compare_nanogpt.py (--settings, --rounds, --like_for_like).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -c "import tqdm, pytest" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__)"
# the CUDA tests first (each attention kernel, the eager engine's CUDA graph)
python3 -m pytest -q -p no:cacheprovider tests/test_standin.py -k "not without_standin" 2>&1 | tail -n 5
[[ " ${PARTS:-nano manual} " == *" nano "* ]] &&
  timeout ${LIMIT_NANO:-450} python3 benchmarks/compare_nanogpt.py --nanogpt "${NANOGPT:-.bench/nanoGPT}" ${NANO_ARGS:-}
[[ " ${PARTS:-nano manual} " == *" manual "* ]] &&
  timeout ${LIMIT_MANUAL:-330} python3 -m benchmarks.bench_manual --compiled "${COMPILED-bfloat16}"
