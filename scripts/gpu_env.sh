# Sourced by the device scripts: install the carried wheels (.whl, scripts/gpu_wheels.sh) into
# /tmp/site and put them and the repo on PYTHONPATH; OUT (the device tool's folder) exists after.
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
