#!/bin/bash
# Device run of scripts/gpu_prefix_hit_check.py (carry .whl made by WITH_AGENT=1 scripts/gpu_wheels.sh).
source scripts/gpu_env.sh
A=${AGENT:-.whl/dsv4-tiny-agent}; base="--model $A --dtype bfloat16 --max-total-tokens 262144 ${EXTRA:-}"
python3 -m kvrelay.cli serve --port 8301 $base > "$OUT/cache.log" 2>&1 &
python3 -m kvrelay.cli serve --port 8302 $base --disable-prefix-cache > "$OUT/nocache.log" 2>&1 &
for p in 8301 8302; do for _ in $(seq 200); do curl -sf localhost:$p/ready > /dev/null && break; sleep 1; done; done
timeout ${CHECK_TIMEOUT:-200} python3 scripts/gpu_prefix_hit_check.py http://127.0.0.1:8301 http://127.0.0.1:8302 ${N:-256} 2>&1 | tee "$OUT/prefix_hit_check.log" | tail -30
kill %1 %2; wait
