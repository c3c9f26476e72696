#!/bin/bash
# One batched GPU session (device tool): install the carried wheels, run the GPU tests and the
# benchmarks, print a short table. Usage: scripts/gpu_run.sh [pytest paths...]
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 benchmarks/decode_throughput.py --steps 20 --out "$OUT/decode_throughput.json" 2>&1 | tee "$OUT/decode_throughput.log" | grep -v Warning | tail -20
python3 -m pytest -q -m gpu -p no:cacheprovider ${@:-tests/gpu/test_triton_pointwise.py tests/gpu/test_engine_gpu.py} 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
