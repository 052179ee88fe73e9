#!/bin/bash
# One archive of every package the GPU host's Python (3.12, no network) lacks for the whole pipeline, the CLI and
# its temporary Prefect server included: .gpu/site.tar.xz, about 38 MiB, where the wheels themselves (fetch-wheels.sh
# plus this venv's transformers, peft, trl, accelerate, liger-kernel, gguf and py-spy) are over the device tool's
# 64 MiB. The wheels are installed here for cp312 with `pip install --target` and packed with xz.
# usage (repository root, venv active): bench/gpu-site.sh
# on the GPU host, `.gpu` carried:  mkdir -p /tmp/site && tar -xJf .gpu/site.tar.xz -C /tmp/site \
#                                   && export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
shared=${SHARED:-$root/../shared}
cd "$root"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$shared/gpu/fetch-wheels.sh" "$tmp/whl" >/dev/null
# not needed on the GPU host: tracking, the UI test, linting. huggingface_hub is pinned below with transformers: the
# image has an older one (1.33), which fetch-wheels.sh leaves out and transformers 5.25 refuses (it needs >= 2.4)
rm -f "$tmp"/whl/{mlflow,selenium,ruff,databricks_sdk,trio}*.whl
pins=$(python3 -m pip list --format=freeze 2>/dev/null | grep -iE '^(transformers|huggingface[-_]hub|peft|trl|accelerate|gguf|liger[-_]kernel)==' || true)
grep -qi '^liger' <<<"$pins" || pins="$pins liger-kernel==0.8.5"
python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp/whl" $pins py-spy graphviz 2>&1 | grep -v 'WARNING: Location' || true
plat=""
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 manylinux_2_5_x86_64; do plat="$plat --platform $p"; done
python3 -m pip install -q --no-deps --no-compile --target "$tmp/site" --python-version 3.12 --implementation cp \
  --only-binary=:all: $plat "$tmp"/whl/*.whl 2>&1 | grep -v 'WARNING: Location' || true
mkdir -p .gpu
XZ_OPT=-T0 tar -cJf .gpu/site.tar.xz -C "$tmp/site" .
du -sh .gpu/site.tar.xz
