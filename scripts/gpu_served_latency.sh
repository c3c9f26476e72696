#!/bin/bash
# Served latency that follows the step (issue 21 item 3), in ONE device call (~6 min):
# a served dsv4-mini (dummy bf16, fast path) at concurrency 1 and 64, 1024 in / 64 out, first as
# today (the whole step budget for prefill), then with --max-decode-slowdown R (default 1.3):
# TPOT against the batch-64 decode step, with TTFT beside it. The server's warm-up
# (models/deepseek_v4/warm_up.py) runs before it reports ready; its log line is printed.
#   run(command="bash scripts/gpu_served_latency.sh", carry=[".whl"], timeout_s=600)
# Results in $OUT: served_latency_off.json, served_latency_r<R>.json, gpu_served_latency.log.
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
R=${R:-1.3}
exec > >(tee "$OUT/gpu_served_latency.log") 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
common=(--model dsv4-mini --modes single --concurrency 1,64 --input-len 1024 --output-len 64
  --prompts-per-level 2 --memory-fraction 0.9 --tokenizer .whl/tokenizer-smollm2
  --verify-prompts 0 --start-timeout 240 --bench-timeout 200)
for label in ${LABELS:-off r$R}; do  # LABELS="r1.3": the limited run alone
  extra=""
  [ "$label" != off ] && extra="--max-decode-slowdown $R"
  echo "== $label ($(date -u +%T)) server args: ${extra:-none}"
  timeout -s INT -k 15 270 python3 benchmarks/pd_vs_single.py "${common[@]}" \
    --server-args "$extra" --out "$OUT/served_latency_$label.json"
  log=$(ls -td /tmp/kvrelay-pd-bench-*/ 2>/dev/null | head -1)
  [ -n "$log" ] && grep -h "warm-up compiled" "$log/single.log" | tail -1
done
