#!/usr/bin/env bash
# Run the GPU tests on the lent GPU machine (no network, no vLLM there): see scripts/gpu/README.md.
#
#   bash scripts/gpu/run.sh stage            # copy the carried chunk(s) (.gpu/*/: bundle, Ray wheels) to /tmp/b
#   bash scripts/gpu/run.sh test [ARGS...]   # stage, install the bundle once, install this repo, run pytest tests/gpu
#                                            # (ARGS naming tests/gpu/... files run those files only)
#   bash scripts/gpu/run.sh bench SCRIPT [ARGS...]   # same set-up, then run a bench/ script
#
# Results land in $OUT: pytest.log, gpu-results.json (numbers the tests recorded), serve.log, gpu.txt.
set -uo pipefail
what=${1:-test}
shift || true
mkdir -p /tmp/b
for d in .gpu/*/; do
  if [ -d "$d" ]; then cp -r "$d". /tmp/b/; fi
done
if [ "$what" = stage ]; then ls -la /tmp/b; exit 0; fi

if [ ! -f /tmp/site/vllm-env.sh ]; then
  bash /tmp/b/install-bundle.sh /tmp/b /tmp/site || { echo "bundle install failed"; exit 1; }
fi
if [ ! -d /tmp/site-test ] && ls /tmp/b/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-test /tmp/b/wheels/*.whl
fi
# Ray (for tests/gpu/test_ray.py, bench_residency.py): its wheel travels in pieces (.gpu/rA .. .gpu/rD), with the
# wheels of the dependencies the machine lacks; joined and checked against RAYWHEEL, installed once.
if [ ! -d /tmp/site-ray ] && [ -f /tmp/b/ray/RAYWHEEL ] && ls /tmp/b/ray/ray.whl.part-* >/dev/null 2>&1; then
  read -r whl sum < /tmp/b/ray/RAYWHEEL
  cat /tmp/b/ray/ray.whl.part-* > "/tmp/b/ray/$whl"
  if [ "$(sha256sum "/tmp/b/ray/$whl" | cut -d' ' -f1)" = "$sum" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-ray /tmp/b/ray/*.whl \
      || echo "Ray wheels failed to install"
  else
    echo "Ray wheel pieces incomplete or corrupt (carry .gpu/rA .. .gpu/rD, see ray-wheels.sh)"; rm -f "/tmp/b/ray/$whl"
  fi
fi
# shellcheck disable=SC1091
source /tmp/site/vllm-env.sh
export PYTHONPATH=/tmp/site-test:$PYTHONPATH
if [ -d /tmp/site-ray ]; then export PYTHONPATH=$PYTHONPATH:/tmp/site-ray PATH=$PATH:/tmp/site-ray/bin; fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/pip-e.log 2>&1 \
  || { cat /tmp/pip-e.log; exit 1; }

OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LORA_EXT_GPU_RESULTS="$OUT/gpu-results.json" LORA_EXT_GPU_SERVE_LOG="$OUT/serve.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import vllm, torch, transformers, peft; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
case "$what" in
  test)
    where=tests/gpu  # the whole suite, unless the arguments name its files (pytest would run both)
    for arg in "$@"; do case "$arg" in tests/gpu/*) where= ;; esac; done
    python3 -m pytest -p no:cacheprovider -o addopts="-ra" --import-mode=importlib $where "$@" 2>&1 | tee "$OUT/pytest.log" ;;
  bench) script=$1; shift; python3 "$script" "$@" 2>&1 | tee "$OUT/bench.log" ;;
esac
