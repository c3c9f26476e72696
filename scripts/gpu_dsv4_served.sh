#!/bin/bash
# Served DeepSeek-V4 on the GPU fast path (device tool, carry .carry: the wheels without
# transformers, tokenizer-smollm2 and dsv4-tiny-agent): `kvrelay repro` of dsv4-tiny-agent in
# float32 at concurrency 64 against concurrency 1, then `kvrelay bench` of a served dsv4-mini
# (dummy weights) at concurrency 1, 8, 64.
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
url=http://127.0.0.1:8100
python3 -m kvrelay.cli serve --model .carry/dsv4-tiny-agent --dtype float32 --port 8100 \
  --max-num-batched-tokens 4096 > "$OUT/serve_tiny.log" 2>&1 &
pid=$!
for _ in $(seq 240); do curl -sf $url/health > /dev/null && break; sleep 1; done
python3 -m kvrelay.cli repro --base-url $url --concurrency ${REPRO_LEVELS:-64} --reference-concurrency 1 \
  --num-sessions ${REPRO_SESSIONS:-64} --turns 3 --max-tokens 64 --ledger off \
  --output-json "$OUT/repro_dsv4_tiny_fp32.json" 2>&1 | tail -25
kill $pid; wait $pid 2>/dev/null
tail -3 "$OUT/serve_tiny.log"
[ -n "$SKIP_MINI" ] && exit 0
python3 benchmarks/pd_vs_single.py --model dsv4-mini --modes single --concurrency 1,8,64 \
  --input-len 1024 --output-len 64 --prompts-per-level 1 --memory-fraction 0.9 \
  --tokenizer .carry/tokenizer-smollm2 --verify-prompts 0 --out "$OUT/served_dsv4_mini.json" 2>&1 \
  | grep -vE "Warning" | tail -12
