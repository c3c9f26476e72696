#!/bin/bash
# Prepares, on THIS machine (it needs the network and .venv), what the GPU machine lacks, in .whl/
# (ignored by .gitignore; carry it: `carry: [".whl"]`):
#   - wheels for Python 3.12 / manylinux x86-64 of the packages the GPU image does not have
#     (shared/reference/gpu-machine.md; the device README's `pip download` pattern), pinned to the
#     versions .venv runs, one version of each (an older one of the same name is removed);
#   - tokenizer-smollm2/: SmolLM2's HF tokenizer saved from the embedded GGUF (the 98 MB GGUF is
#     too big to carry): dummy dense servers on the GPU use it (`--tokenizer`), so do the served
#     benchmarks and tests/gpu/test_pd_cuda_ipc.py.
# Not carried: transformers (5.17 is on the GPU image; nothing in the quick GPU tier needs 5.24:
# WITH_TRANSFORMERS=1 adds it, ~12 MB) and the dsv4-tiny-agent (WITH_AGENT=1 copies it to
# .whl/dsv4-tiny-agent, ~42 MB: over the ~60 MiB budget together with the rest, and no quick-tier
# test needs it).
# WITH_NIXL=1 adds a slim NIXL wheel instead of the agent (PART=nixl of scripts/gpu_session.sh).
# Usage: scripts/gpu_wheels.sh      then: du -sh .whl   (keep the carried total under ~60 MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WHL=.whl
mkdir -p "$WHL"

# NAME==VERSION of the version installed in .venv (the one CI runs); the latest where .venv has
# none (python-multipart and httptools: uvicorn uses httptools for HTTP/1 when it is there).
spec() {
  "$PY" -c "import importlib.metadata as m, sys
try: print(sys.argv[1] + '==' + m.version(sys.argv[1]))
except m.PackageNotFoundError: print(sys.argv[1])" "$1"
}

# fastapi + its stack, the engine IPC (pyzmq, msgspec), GGUF reading, structured outputs, and the
# openai client of the served tests (openai 3.x imports httpx2, which needs httpcore2 and
# truststore; jiter and sniffio are not on the GPU image either).
PKGS="fastapi opentelemetry-api starlette pydantic pydantic-core annotated-types typing-inspection
python-multipart uvicorn httptools pyzmq msgspec gguf llguidance openai httpx2 httpcore2 truststore
jiter sniffio"
[ -n "${WITH_TRANSFORMERS:-}" ] && PKGS="$PKGS transformers"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
specs=()
for p in $PKGS; do specs+=("$(spec "$p")"); done
# llguidance >= 1.9 is tagged manylinux_2_31 (gpu-machine.md): pip matches N exactly.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$tmp" "${specs[@]}" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
for f in "$tmp"/*.whl; do
  name=$(basename "$f" | cut -d- -f1)  # the wheel's normalised name (underscores)
  for old in "$WHL/$name"-*.whl; do
    [ -e "$old" ] && [ "$(basename "$old")" != "$(basename "$f")" ] && rm -v "$old"
  done
  mv -f "$f" "$WHL/"
done

if [ ! -f "$WHL/tokenizer-smollm2/tokenizer.json" ]; then
  KVRELAY_CACHE_DIR=off "$PY" - "$WHL/tokenizer-smollm2" <<'EOF'
import sys

from kvrelay.weights.loader import resolve
from kvrelay.weights.tokenizer import load_tokenizer

load_tokenizer(resolve("smollm2")).save_pretrained(sys.argv[1])
EOF
fi

if [ -n "${WITH_AGENT:-}" ]; then
  AGENT=${AGENT:-../shared/models/dsv4-tiny-agent}
  mkdir -p "$WHL/dsv4-tiny-agent"
  cp -u "$AGENT"/*.json "$AGENT"/*.safetensors "$AGENT"/*.jinja "$AGENT"/*.py "$WHL/dsv4-tiny-agent/"
fi

# WITH_NIXL=1: a slim nixl-cu13 wheel (~11 MB; scripts/nixl_slim_wheel.py) in .whl/nixl/, which
# PART=nixl installs. Not beside the agent: the two with the rest are over one call's 64 MiB.
if [ -n "${WITH_NIXL:-}" ]; then
  [ -n "${WITH_AGENT:-}" ] && { echo "WITH_NIXL and WITH_AGENT: over 64 MiB together" >&2; exit 2; }
  rm -rf "$WHL/dsv4-tiny-agent" "$WHL/nixl"
  "$PY" scripts/nixl_slim_wheel.py --dest "$WHL/nixl" 2> >(grep -v "is ignored" >&2)
else
  rm -rf "$WHL/nixl"
fi

ls "$WHL"
du -sh "$WHL"
