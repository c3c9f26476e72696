#!/bin/bash
# One batched GPU session (device tool): install the carried wheels, run the benchmarks named in
# BENCHES (default: dsv4; also: dsv4-decode, profile, moe, sparse-attn, indexer, decode, ipc, pd, split, split-dsv4, nvfp4 — pd and split need
# .whl/tokenizer-smollm2, an HF tokenizer directory saved from the embedded GGUF, as the GGUF
# itself is too big to carry), then the GPU tests, print short tables.
# Usage: BENCHES="decode dsv4" scripts/gpu_run.sh [pytest paths...]
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
for b in ${BENCHES:-dsv4}; do
  case $b in
    decode) python3 benchmarks/decode_throughput.py --steps 20 --out "$OUT/decode_throughput.json" 2>&1 | tee "$OUT/decode_throughput.log" | grep -v Warning | tail -20 ;;
    pd) python3 benchmarks/pd_vs_single.py --tokenizer .whl/tokenizer-smollm2 --gpus 0 --out "$OUT/pd_vs_single.json" $PD_ARGS 2>&1 | tee "$OUT/pd_vs_single.log" | grep -E "^(mode|single|pd|verify)" ;;
    ipc) python3 benchmarks/ipc_copy.py --out "$OUT/ipc_copy.json" 2>&1 | tee "$OUT/ipc_copy.log" | tail -12 ;;
    split) python3 benchmarks/step_split.py --tokenizer .whl/tokenizer-smollm2 --out "$OUT/step_split.json" 2>&1 | tee "$OUT/step_split.log" | grep -vE "Warning|^wrote" | tail -16 ;;
    split-dsv4) python3 benchmarks/step_split.py --model dsv4-mini --concurrency 1,8 --input-len 256 --output-len 16 --prompts-per-level 1 --every 2 --tokenizer .whl/tokenizer-smollm2 --out "$OUT/step_split_dsv4.json" 2>&1 | tee "$OUT/step_split_dsv4.log" | grep -vE "Warning|^wrote" | tail -16 ;;
    nvfp4) python3 benchmarks/nvfp4_dequant.py --out "$OUT/nvfp4_dequant.json" 2>&1 | tee "$OUT/nvfp4_dequant.log" | tail -6 ;;
    dsv4-decode) python3 benchmarks/dsv4_decode.py --out "$OUT/dsv4_decode.json" $DSV4_ARGS 2>&1 | tee "$OUT/dsv4_decode.log" | grep -v Warning | tail -20 ;;
    profile) python3 benchmarks/dsv4_profile.py --out "$OUT/dsv4_profile.json" $PROFILE_ARGS 2>&1 | tee "$OUT/dsv4_profile.log" | grep -vE "Warning|USDT|^  .*us .*x " | tail -30 ;;
    moe) python3 benchmarks/moe_kernel.py --out "$OUT/moe_kernel.json" $MOE_ARGS 2>&1 | tee "$OUT/moe_kernel.log" | tail -14 ;;
    sparse-attn) python3 benchmarks/sparse_attention_kernel.py --out "$OUT/sparse_attention_kernel.json" 2>&1 | tee "$OUT/sparse_attention_kernel.log" | tail -24 ;;
    indexer) python3 benchmarks/indexer_kernel.py --out "$OUT/indexer_kernel.json" 2>&1 | tee "$OUT/indexer_kernel.log" | tail -14 ;;
    dsv4) python3 benchmarks/dsv4_reference.py --out "$OUT/dsv4_reference.json" 2>&1 | tee "$OUT/dsv4_reference.log" | grep -v Warning | tail -20 ;;
  esac
done
python3 -m pytest -q -rfE -m gpu -p no:cacheprovider $PYTEST_ARGS ${@:-tests/gpu} 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
