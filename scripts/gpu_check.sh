#!/bin/bash
# The GPU check in ONE device call of at most ~9 minutes: install the carried wheels, run the quick
# GPU test tier (`pytest -m gpu`), then the headline benchmarks, and print one short table.
#
# Here first (network, .venv): scripts/gpu_wheels.sh   (fills the ignored .whl/, ~14 MB)
# Then, through the device tool:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=600)
#
# Phases, each under `timeout` and all under one deadline (BUDGET_S, default 530 s after the
# start), in this order (a phase that the deadline leaves < 20 s for is skipped):
#   install  the wheels of .whl/ into /tmp/site                                        cap  60 s
#   tests    pytest -m gpu tests/gpu tests/quant: the quick tier in 4 pytest-xdist workers
#            (about 3 min; serial, kernel files first: about 6-8 min; both estimated), -v,
#            every test's duration in gpu_tests.log; then one line lists the tests that
#            did not run (those the cap stopped)                                         cap 300 s
#   decode   benchmarks/decode_throughput.py: llama-1b (dummy bf16), batch 1 and 64    cap 100 s
#   dsv4     benchmarks/dsv4_decode.py: dsv4-mini fast path, batch 1/8/64 at context
#            4096, prefill 4096 (no reference path)                                     cap 200 s
#   served   benchmarks/pd_vs_single.py --modes single: a served dsv4-mini at
#            concurrency 1, 1024 in / 64 out (tokenizer: .whl/tokenizer-smollm2)        cap 200 s
# A phase stopped at its cap gets SIGINT (pytest and the benchmarks stop their servers and
# print what they have), then SIGKILL 15 s later; servers a phase started in a session of their
# own (pd_vs_single's) are stopped by id after it.
# Results in $OUT (7 files at most): gpu_check.log (all the console output), gpu_tests.log,
# decode_throughput.json, dsv4_decode.json, served_dsv4_mini.json, summary.json, and
# served_server.log only when the served phase failed.
# Environment: BUDGET_S; MARK (default gpu: the quick tier; gpu_full: the exhaustive one, a file
# or two per call), TESTS (default "tests/gpu tests/quant": all that `-m gpu` selects), TESTS_CAP
# (default 300 s), XDIST (default 4: 4 pytest-xdist workers, `--dist loadgroup`: the engines of
# one path in one worker, every other file whole, the longest groups first, see
# tests/conftest.py; 0: serial, the kernel files first and the served paths after them, so that
# a run stopped at the cap has run every kernel: what `pytest -m gpu` does by hand),
# PYTEST_ARGS (more pytest arguments); SKIP (phases to skip, e.g. SKIP="decode dsv4 served").
set -o pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-out} MARK=${MARK:-gpu} TESTS=${TESTS:-tests/gpu tests/quant} PYTEST_ARGS=${PYTEST_ARGS:-}
export XDIST=${XDIST:-4}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-530}
START=$(date +%s)
exec > >(tee "$OUT/gpu_check.log") 2>&1

export PYTHONUNBUFFERED=1
export GPU_CHECK_TAG="gpu-check-$$-$START"  # inherited by everything this script starts
read -r _ _ _ MYSID _ < <(cut -d')' -f2- /proc/$$/stat)  # state ppid pgrp session

declare -A WALL RC

leftovers() {  # pids of processes this script started (by the tag) in another session
  local d pid
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    [ "$pid" = "$$" ] && continue
    grep -qz "^GPU_CHECK_TAG=$GPU_CHECK_TAG\$" "$d/environ" 2>/dev/null || continue
    set -- $(cut -d')' -f2- "$d/stat" 2>/dev/null)
    [ -n "${4:-}" ] && [ "$4" != "$MYSID" ] && echo "$pid"
  done
}

stop_leftovers() {
  local pids
  pids=$(leftovers)
  [ -z "$pids" ] && return 0
  echo "stopping processes left in sessions of their own: $(echo $pids)"
  kill -INT $pids 2>/dev/null
  sleep 5
  pids=$(leftovers)
  [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
  return 0
}

phase() {  # phase NAME CAP_S COMMAND...: run COMMAND under the cap and the shared deadline
  local name=$1 want=$2 left t0
  shift 2
  left=$((BUDGET_S - ($(date +%s) - START) - 5))
  ((want > left)) && want=$left
  if [[ " ${SKIP:-} " == *" $name "* ]] || ((want < 20)); then
    echo "== $name: skipped ($([[ " ${SKIP:-} " == *" $name "* ]] && echo SKIP || echo "${left} s of the budget left"))"
    RC[$name]=skipped
    WALL[$name]=0
    return
  fi
  echo "== $name (cap ${want} s, $(date -u +%T)): $*"
  t0=$(date +%s)
  timeout -s INT -k 15 "$want" "$@"
  RC[$name]=$?
  WALL[$name]=$(($(date +%s) - t0))
  stop_leftovers
  echo "== $name: exit ${RC[$name]} in ${WALL[$name]} s$([ "${RC[$name]}" = 124 ] && echo ' (stopped at its cap)')"
}

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), budget ${BUDGET_S} s"

install() {
  if [ -z "$(ls .whl/*.whl 2>/dev/null)" ]; then
    echo "no .whl/*.whl: run scripts/gpu_wheels.sh here first and carry .whl"
    return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
}
run_tests() {
  # -v: each test as it ends; --durations=0: every test's time (to recalibrate the tiers);
  # KVRELAY_TEST_PLAN: tests/conftest.py writes there the tests pytest selected (for not_run)
  local par=""
  if [ "$XDIST" != 0 ]; then  # test files in parallel processes on the one GPU: compiles overlap
    python3 -c "import xdist" 2>/dev/null \
      && par="-n $XDIST --dist loadgroup --no-loadscope-reorder" || echo "no pytest-xdist: serial"
  fi
  KVRELAY_TEST_PLAN="$PLAN" python3 -m pytest -m "$MARK" -v -rfE -p no:cacheprovider \
    --durations=0 $par $PYTEST_ARGS $TESTS > "$OUT/gpu_tests.log" 2>&1
  local rc=$?
  echo "slowest:"
  grep -E "^[0-9]+\.[0-9]+s (call|setup|teardown) " "$OUT/gpu_tests.log" | head -12
  grep -E "^(FAILED|ERROR) " "$OUT/gpu_tests.log" | head -20
  tail -1 "$OUT/gpu_tests.log"
  return $rc
}
not_run() {
  # The selected tests that gpu_tests.log shows no outcome for, on one line (and their count in
  # $NOT_RUN for the table): what a run stopped at its cap (or a crash) left out.
  NOT_RUN=$(python3 - "$PLAN" "$OUT/gpu_tests.log" "${RC[tests]}" <<'EOF'
import re
import sys

plan_path, log_path, rc = sys.argv[1:4]


def norm(nodeid):  # xdist's loadgroup appends "@group"
    at = nodeid.rfind("@")
    return nodeid[:at] if at > nodeid.rfind("]") else nodeid


try:
    with open(plan_path) as f:
        plan = [norm(x) for x in f.read().splitlines() if x]
except OSError:
    print("tests not run: unknown (pytest wrote no list of its tests: stopped before collecting?)",
          file=sys.stderr)
    print("not run: unknown")
    sys.exit()
done, seen = set(), set()
outcome = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
try:
    with open(log_path, errors="replace") as f:
        for line in f:
            # a parametrize id may hold spaces: "test_x[(1, 4)]"
            ids = {norm(i) for i in re.findall(r"(tests/\S+::[^\s\[]+(?:\[[^\]]*\])?\S*)", line)}
            (done if outcome.search(line) else seen).update(ids)
except OSError:
    pass
missing = [t for t in plan if t not in done]
if not missing:
    print(f"tests not run: none (all {len(plan)} selected tests ran)", file=sys.stderr)
else:
    why = "stopped at the cap" if rc == "124" else f"pytest exit {rc}"
    print(f"tests not run ({len(missing)} of {len(plan)}, {why}): " + " ".join(missing),
          file=sys.stderr)
    stopped = [t for t in missing if t in seen]
    if stopped:
        print("  of these, started but not finished: " + " ".join(stopped), file=sys.stderr)
print(f"{len(missing)} of {len(plan)} not run")
EOF
  )
}
export -f install run_tests  # `timeout` runs commands, not shell functions: bash -c NAME

phase install 60 bash -c install
export PYTHONPATH=/tmp/site:$PWD
export PLAN=/tmp/gpu_check_plan.$$.txt
rm -f "$PLAN"
phase tests "${TESTS_CAP:-300}" bash -c run_tests
NOT_RUN=""
[ "${RC[tests]}" != skipped ] && not_run

phase decode 100 python3 benchmarks/decode_throughput.py --batch-sizes 1,64 --steps 20 --skip-hf \
  --out "$OUT/decode_throughput.json"

phase dsv4 200 python3 benchmarks/dsv4_decode.py --batches 1,8,64 --contexts 4096 \
  --reference-batches "" --steps 10 --prefill 4096 --out "$OUT/dsv4_decode.json"

phase served 200 python3 benchmarks/pd_vs_single.py --model dsv4-mini --modes single \
  --concurrency 1 --input-len 1024 --output-len 64 --prompts-per-level 8 --memory-fraction 0.9 \
  --tokenizer .whl/tokenizer-smollm2 --verify-prompts 0 --start-timeout 180 --bench-timeout 120 \
  --out "$OUT/served_dsv4_mini.json"
if [ "${RC[served]}" != 0 ] && [ "${RC[served]}" != skipped ]; then
  log=$(ls -td /tmp/kvrelay-pd-bench-*/ 2>/dev/null | head -1)
  [ -n "$log" ] && tail -c 200000 "$log/single.log" > "$OUT/served_server.log" 2>/dev/null
fi

export WALL_INSTALL=${WALL[install]} WALL_TESTS=${WALL[tests]} WALL_DECODE=${WALL[decode]}
export WALL_DSV4=${WALL[dsv4]} WALL_SERVED=${WALL[served]} RC_INSTALL=${RC[install]}
export RC_TESTS=${RC[tests]} RC_DECODE=${RC[decode]} RC_DSV4=${RC[dsv4]} RC_SERVED=${RC[served]}
export NOT_RUN
export TOTAL_S=$(($(date +%s) - START)) OUT
python3 - <<'EOF'
"""The one short table: the test tier, then one line per headline number (with the committed
H200 figure of benchmarks/results beside it where there is one); summary.json holds the same."""
import json
import os
import re

out = os.environ["OUT"]
phases = ["install", "tests", "decode", "dsv4", "served"]
wall = {p: int(os.environ.get(f"WALL_{p.upper()}") or 0) for p in phases}
rc = {p: os.environ.get(f"RC_{p.upper()}", "") for p in phases}


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


rows = []  # (what, value, committed)
tests = "not run"
try:
    with open(os.path.join(out, "gpu_tests.log")) as f:
        lines = [x for x in f.read().splitlines()
                 if re.search(r"\d+ (passed|failed|errors?|skipped)\b.* in [\d.]+s", x)]
    tests = lines[-1].strip("= ") if lines else "no result line"
except OSError:
    pass
not_run = f"; {os.environ['NOT_RUN']}" if os.environ.get("NOT_RUN") else ""
rows.append((f"tests: pytest -m {os.environ['MARK']}", f"{tests}; exit {rc['tests']}{not_run}", ""))

d = load(os.path.join(out, "decode_throughput.json"))
old = load("benchmarks/results/decode_throughput_h200.json")
for b in (1, 64):
    def pick(rep, b=b):
        for r in (rep or {}).get("rows", []):
            if r["batch"] == b and r["cuda_graphs"]:
                return r
    r, o = pick(d), pick(old)
    fmt = lambda r: f"{r['step_ms']:.2f} ms/step {r['tokens_per_s']:.0f} tok/s ({r['forward_frac_of_copy']:.2f} of copy BW)"
    rows.append((f"dense llama-1b decode, batch {b}, graphs", fmt(r) if r else "-", fmt(o) if o else ""))

d = load(os.path.join(out, "dsv4_decode.json"))
if d is None:  # stopped before its end: the rows it printed
    try:
        with open(os.path.join(out, "gpu_check.log")) as f:
            got = [json.loads(x) for x in f if x.startswith('{"step_ms"')]
        d = {"decode": got} if got else None
    except (OSError, ValueError):
        d = None
old = load("benchmarks/results/dsv4_decode_h200.json")
for b in (1, 8, 64):
    def pick(rep, b=b):
        for r in (rep or {}).get("decode", []):
            if r.get("path") == "fast" and r["batch"] == b and r["context"] == 4096:
                return r
    r, o = pick(d), pick(old)
    fmt = lambda r: f"{r['step_ms']:.1f} ms/step ({r['x_floor']:.1f}x floor)"
    rows.append((f"dsv4-mini decode, batch {b}, ctx 4096", fmt(r) if r else "-", fmt(o) if o else ""))
p, po = (d or {}).get("prefill"), (old or {}).get("prefill")
rows.append(("dsv4-mini prefill 4096 tokens", f"{p['fast_tok_s']:.0f} tok/s" if p else "-",
             f"{po['fast_tok_s']:.0f} tok/s" if po else ""))

d = load(os.path.join(out, "served_dsv4_mini.json"))
old = load("benchmarks/results/served_dsv4_mini_h200.json")
def pick(rep):
    for r in ((rep or {}).get("modes") or {}).get("single", []):
        if r["concurrency"] == 1:
            return r
r, o = pick(d), pick(old)
fmt = lambda r: f"TTFT {r['ttft_ms_mean']:.0f} ms TPOT {r['tpot_ms_mean']:.1f} ms ({r['completed']} ok {r['failed']} failed)"
rows.append(("served dsv4-mini, concurrency 1, 1024/64", fmt(r) if r else "-", fmt(o) if o else ""))

w, v = max(len(x[0]) for x in rows), max(len(x[1]) for x in rows[1:])
print()
print(f"{'':{w}}  {'this run':<{v}}  committed H200 result")
for what, val, was in rows:
    print(f"{what:<{w}}  {val:<{v}}  {was}")
print("phases (s): " + ", ".join(f"{p} {wall[p]} (exit {rc[p]})" for p in phases)
      + f"; total {os.environ['TOTAL_S']}")
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump({"rows": [dict(what=a, value=b, committed=c) for a, b, c in rows],
               "phase_wall_s": wall, "phase_exit": rc, "total_s": int(os.environ["TOTAL_S"])},
              f, indent=1)
EOF
exec >&- 2>&-
wait  # for tee to write the end of gpu_check.log
