#!/bin/bash
# Issue 27 on the GPU (device tool): the tiny DeepSeek-V4 agent behind `kvrelay up` (bf16,
# cuda_ipc, one H200 for both servers), `kvrelay repro` at concurrency 128 and 256 (3 turns x 64
# tokens, tools sent), then the launcher's log checked for restarts. Carry .whl made by
# `WITH_AGENT=1 scripts/gpu_wheels.sh` (the wheels and .whl/dsv4-tiny-agent).
# Usage (device tool): run(command="bash scripts/gpu_overload.sh", carry=[".whl"])
AGENT=${AGENT:-.whl/dsv4-tiny-agent}
source scripts/gpu_env.sh
logs="$OUT/up-logs"  # comes back with the results
python3 -m kvrelay.cli up --port 8300 --log-dir "$logs" --model "$AGENT" --health-timeout 300 \
  --server-args "--dtype bfloat16 --max-total-tokens 262144" \
  --prefill-args "--transfer-backend cuda_ipc" --decode-args "--transfer-backend cuda_ipc" \
  > "$OUT/overload_up.log" 2>&1 &
up=$!
for _ in $(seq 300); do grep -q "kvrelay up ready" "$OUT/overload_up.log" && break; sleep 1; done
timeout ${REPRO_TIMEOUT:-300} python3 -m kvrelay.cli repro --base-url http://127.0.0.1:8300 \
  --concurrency 128,256 --reference-concurrency 32 --num-sessions 256 --turns 3 \
  --max-tokens 64 --ledger off \
  --output-json "$OUT/repro_overload.json" 2>&1 | tail -20
echo "repro exit: ${PIPESTATUS[0]}"
echo "launcher restarts: $(grep -cE 'action=(restart|co-restart|give_up)' "$OUT/overload_up.log")"
grep -E "kvrelay_router_(requests|failures)_total" <(curl -s http://127.0.0.1:8300/metrics)
kill -INT $up; wait $up
tail -4 "$OUT/overload_up.log"
