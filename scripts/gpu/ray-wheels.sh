#!/usr/bin/env bash
# Build the Ray chunks the GPU machine needs for tests/gpu/test_ray.py (it has no Ray and no network).
#
#   bash scripts/gpu/ray-wheels.sh            # -> .gpu/rA .gpu/rB .gpu/rC (16 MiB each) and .gpu/rD (about 41 MiB)
#
# Ray 2.58.0 (the release whose LLM image ships vLLM 0.26.0) for CPython 3.12, split so that its pieces ride
# along with the vLLM bundle's chunks (each device call carries less than 64 MiB with the working tree): rA with
# .gpu/p0, rB with .gpu/p1, rC with .gpu/p2 (the first work call), rD (the rest of the wheel) in the next call; plus the wheels of ray[serve]'s dependencies that the machine's image
# lacks (KINDS.md lists what it has; fastapi, starlette, uvicorn and watchfiles come with the vLLM bundle).
# scripts/gpu/run.sh joins the chunks, checks the sha256 in RAYWHEEL and installs everything into /tmp/site-ray.
set -euo pipefail
cd "$(dirname "$0")/../.."
RAY_VERSION=${RAY_VERSION:-2.58.0}
CACHE=${CACHE:-/tmp/ray-wheel-cache}
mkdir -p "$CACHE"
PLAT=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 any; do
  PLAT+=(--platform "$tag")
done
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
  -d "$CACHE" "ray[serve]==$RAY_VERSION"
# The dependencies the GPU machine lacks (the rest of ray[serve]'s closure is already there).
MISSING=(aiohttp_cors colorful cffi cryptography distlib google_api_core google_auth googleapis_common_protos httptools
         jsonref jsonschema jsonschema_specifications mmh3 opencensus opencensus_context opentelemetry_api
         opentelemetry_exporter_prometheus opentelemetry_proto opentelemetry_sdk opentelemetry_semantic_conventions
         platformdirs proto_plus pyasn1 pyasn1_modules pycparser python_discovery python_dotenv referencing rpds_py
         smart_open virtualenv websockets)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
  -d "$CACHE" jsonref
rm -rf .gpu/ray0 .gpu/ray1 .gpu/rA .gpu/rB .gpu/rC .gpu/rD
mkdir -p .gpu/rA/ray .gpu/rB/ray .gpu/rC/ray .gpu/rD/ray
whl=$(cd "$CACHE" && ls "ray-$RAY_VERSION"-cp312-*.whl)
split -b 16M -a 2 "$CACHE/$whl" .gpu/rD/ray/ray.whl.part-
mv .gpu/rD/ray/ray.whl.part-aa .gpu/rA/ray/
mv .gpu/rD/ray/ray.whl.part-ab .gpu/rB/ray/
mv .gpu/rD/ray/ray.whl.part-ac .gpu/rC/ray/
echo "$whl $(sha256sum "$CACHE/$whl" | cut -d' ' -f1)" > .gpu/rD/ray/RAYWHEEL
for name in "${MISSING[@]}"; do
  found=$(cd "$CACHE" && ls "$name"-[0-9]*.whl 2>/dev/null | head -n 1)
  [ -n "$found" ] || { echo "no wheel for $name in $CACHE"; exit 1; }
  cp "$CACHE/$found" .gpu/rD/ray/
done
du -sh .gpu/rA .gpu/rB .gpu/rC .gpu/rD
