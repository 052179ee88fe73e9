#!/bin/bash
# Wheels that bench/bench_train.py needs on a GPU host without network, small enough to travel together
# (the device tool carries at most 64 MiB): .whlb = the project's wheels that `import tasks.train_adapter`
# needs and the host image lacks, plus this venv's transformers and liger-kernel; .whlu = Unsloth's set
# (../shared/bench/fetch-unsloth-wheels.sh) without its web UI (studio/, 82 MB unpacked), without hf_transfer
# and without the wheels .whlb already holds. About 34 + 17 MiB.
# usage (repository root, venv active): bench/gpu-wheels.sh [--no-unsloth]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
shared=${SHARED:-$root/../shared}
cd "$root"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$shared/gpu/fetch-wheels.sh" "$tmp/all" >/dev/null
rm -rf .whlb && mkdir -p .whlb
keep="amplitude_analytics annotated_types asgi_lifespan bitsandbytes cachetools coolname dill exceptiongroup griffecli
griffelib h2 hpack httpcore2 httpx2 hyperframe jsonpointer jsonschema jsonschema_specifications opentelemetry_api orjson
pendulum prefect pydantic pydantic_core pydantic_extra_types pydantic_settings python_dotenv python_slugify redis
referencing rfc3339_validator rpds_py sniffio starlette toml truststore typing_inspection tzdata websockets text_unidecode"
for d in $keep; do cp "$tmp/all/$d"-[0-9]*.whl .whlb/ 2>/dev/null || echo "gpu-wheels: no wheel for $d" >&2; done
versions=$(python3 -m pip list --format=freeze 2>/dev/null | grep -iE '^(transformers|liger[-_]kernel)==' || true)
grep -qi '^liger' <<<"$versions" || versions="$versions liger-kernel==0.8.5"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .whlb $versions 2>&1 | grep -v 'WARNING: Location' || true
if [[ "${1:-}" != --no-unsloth ]]; then
  rm -rf .whlu && "$shared/bench/fetch-unsloth-wheels.sh" .whlu >/dev/null
  w=$(ls .whlu/unsloth-2*.whl)
  (mkdir "$tmp/u" && cd "$tmp/u" && python3 -m zipfile -e "$root/$w" . && rm -rf studio && rm "$root/$w" \
     && python3 -m zipfile -c "$root/$w" ./*)
  rm -f .whlu/hf_transfer-*.whl .whlu/bitsandbytes-*.whl .whlu/pydantic-*.whl .whlu/pydantic_core-*.whl \
     .whlu/annotated_types-*.whl .whlu/typing_inspection-*.whl
fi
du -sh .whlb .whlu 2>/dev/null
