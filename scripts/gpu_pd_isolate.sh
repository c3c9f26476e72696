#!/bin/bash
# Which part of a DeepSeek-V4 PD stack on the GPU gives wrong answers under load with warm caches?
# For each variant: the tiny agent behind `kvrelay up` (bf16), `kvrelay repro` reference at
# concurrency 128 (cold caches), then 256 (caches warm from the reference). Variants:
#   ipc        cuda_ipc, prefix caches on (what corrupted 3 turns at 128/256 on 2026-12-03)
#   tcp        tcp transport, prefix caches on
#   ipc-nocache  cuda_ipc, --disable-prefix-cache on both servers
#   single     one server (no PD), prefix cache on
#   single-nocache  one server, --disable-prefix-cache (bf16 batch numerics alone)
#   single-fp32     one server, prefix cache on, float32
# Carry .whl (WITH_AGENT=1 scripts/gpu_wheels.sh). Usage: VARIANTS="ipc tcp" bash scripts/gpu_pd_isolate.sh
AGENT=${AGENT:-.whl/dsv4-tiny-agent}
source scripts/gpu_env.sh
base="--dtype bfloat16 --max-total-tokens 262144"
for v in ${VARIANTS:-ipc tcp ipc-nocache single}; do
  logs=/tmp/logs-$v; mkdir -p $logs; port=8300
  case $v in
    ipc) args=(--server-args "$base --transfer-backend cuda_ipc") ;;
    tcp) args=(--server-args "$base --transfer-backend tcp") ;;
    ipc-nocache) args=(--server-args "$base --transfer-backend cuda_ipc --disable-prefix-cache") ;;
    single) args=($base) ;;
    single-nocache) args=($base --disable-prefix-cache) ;;
    single-fp32) args=(--dtype float32 --max-total-tokens 262144) ;;
  esac
  t0=$(date +%s)
  if [[ $v == single* ]]; then
    python3 -m kvrelay.cli serve --port $port --model "$AGENT" "${args[@]}" > $logs/single.log 2>&1 &
    pid=$!
    for _ in $(seq 200); do curl -sf localhost:$port/ready > /dev/null && break; sleep 1; done
  else
    python3 -m kvrelay.cli up --port $port --log-dir $logs --model "$AGENT" --health-timeout 300 \
      "${args[@]}" > $logs/up.log 2>&1 &
    pid=$!
    for _ in $(seq 200); do grep -q "kvrelay up ready" $logs/up.log && break; sleep 1; done
  fi
  echo "== $v: ready after $(( $(date +%s) - t0 )) s"
  timeout 150 python3 -m kvrelay.cli repro --base-url http://127.0.0.1:$port --concurrency 256 \
    --reference-concurrency 128 --num-sessions 256 --turns 3 --max-tokens 64 --ledger off \
    --output-json "$OUT/repro_$v.json" 2>&1 | grep -E "^ +[0-9]+ +256|verdict|failed requests|^#[0-9]" | head -8
  curl -s localhost:$port/metrics | grep -E "^kvrelay_router_(requests|failures)_total" | tr '\n' ' '; echo
  kill -INT $pid; wait $pid
  grep -hE "WARNING|ERROR" $logs/*.log | grep -v "tool call parse" | cut -c1-220 | sort | uniq -c | sort -rn | head -5
  echo "== $v: done after $(( $(date +%s) - t0 )) s"
done
tar czf "$OUT/logs.tgz" /tmp/logs-* 2>/dev/null
