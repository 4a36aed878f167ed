#!/usr/bin/env bash
# Run the CPU test suite against each given vLLM release, each in its own venv (.venv-vllm-X.Y.Z), and
# record a results table. Opt-in: every venv is a full vLLM install (about 5 minutes and 8 GB each).
#
#   bash scripts/test-vllm-matrix.sh 0.26.0 0.33.0          # some releases
#   bash scripts/test-vllm-matrix.sh all                    # every minor release the plugin supports
#
# Results: bench/results/vllm_matrix.json (merged with earlier runs), and a line per release on stdout.
# MATRIX_PIP_ARGS: extra requirements for the vLLM install. Where a local wheel store offers a CPU-only torch
# (e.g. torch 2.13.0+cpu, which sorts above PyPI's 2.13.0), vLLM 0.27-0.32 otherwise get it next to their
# pinned CUDA builds of torchvision/torchaudio/torchcodec, which then fail to load when transformers imports
# them, before any plugin code runs; MATRIX_PIP_ARGS='torch!=2.13.0+cpu' keeps PyPI's build.
# Exit code: non-zero if any release's suite failed.
set -uo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
if [ "${versions[0]:-}" = all ] || [ ${#versions[@]} -eq 0 ]; then
  versions=(0.26.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0 0.33.0)
fi
status=0
for v in "${versions[@]}"; do
  venv=".venv-vllm-$v"
  log="/tmp/vllm-matrix-$v.log"
  echo "== vLLM $v ($venv, log $log)"
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" || { echo "venv failed"; status=1; continue; }
  fi
  # vLLM alone first, so that its own pins choose torch and torchvision together; then this package and the
  # test tools, which leave them as they are.
  # Ray Serve LLM 2.58 (its image ships vLLM 0.26.0) imports vLLM 0.26's modules: its tests run on that release.
  extras=(-e '.[test]')
  if [ "$v" = 0.26.0 ]; then extras=(-e '.[test,ray]' 'ray==2.58.0'); fi
  # One retry: a registry that drops a connection mid-download fails one attempt, not the leg. A failure
  # prints the log's tail and the free disk, so that CI's own output says why (the log stays on its machine).
  # shellcheck disable=SC2086  # MATRIX_PIP_ARGS is a list of requirement specs
  install() { "$venv/bin/pip" install -q "vllm==$v" ${MATRIX_PIP_ARGS:-} && "$venv/bin/pip" install -q "${extras[@]}"; }
  if ! install >"$log" 2>&1 && ! { echo "== retry"; install; } >>"$log" 2>&1; then
    echo "install of vllm==$v failed twice (see $log); its last lines, then the free disk:"
    tail -n 25 "$log" | cut -c1-300
    df -h "$venv" /tmp 2>/dev/null
    summary="install failed"
    rc=1
  else
    "$venv/bin/python" -X faulthandler -m pytest -q -p no:cacheprovider >>"$log" 2>&1  # (a crash prints its threads)
    rc=$?
    summary=$(grep -aE "^[=]* ?[0-9]+ (passed|failed)" "$log" | tail -n 1 | tr -d '=' | sed 's/^ *//; s/ in [0-9.]*s.*//')
  fi
  [ "$rc" -eq 0 ] || status=1
  echo "vLLM $v: rc=$rc ${summary:-}"
  python3 - "$v" "$rc" "${summary:-}" <<'PY'
import json, sys, time, pathlib
v, rc, summary = sys.argv[1], int(sys.argv[2]), sys.argv[3]
path = pathlib.Path("bench/results/vllm_matrix.json")
data = json.loads(path.read_text()) if path.exists() else {}
data[v] = {"passed": rc == 0, "summary": summary, "date": time.strftime("%Y-%m-%d")}
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps(dict(sorted(data.items(), key=lambda kv: [int(x) for x in kv[0].split(".")])), indent=2) + "\n")
PY
done
exit $status
