#!/bin/bash
# Packages for a GPU host that has Python and a CUDA build of torch but no network: every package of this
# virtual environment that the host lacks, installed for the host's Python into one folder and packed as
# .gpu/site.tar.xz; with --unsloth also Unsloth's own set (its pins differ from the project's) as .gpu/unsloth.tar.xz.
# A GPU host with network needs none of this: bench/README.md, "Set-up on a GPU host".
#
# usage (repository root, this project's venv active, network here):
#   bench/gpu-site.sh [--python 3.12] [--host-packages FILE] [--cuda 13] [--unsloth] [--list]
#     --host-packages  `python3 -m pip list --format=freeze` run on the GPU host: what it has is not packed
#     --cuda           keep only bitsandbytes' libraries for this CUDA major (and its CPU one): a smaller archive
#     --list           print the pinned packages it would fetch, fetch nothing
# on the GPU host, `.gpu` copied beside the repository:
#   mkdir -p /tmp/site && tar -xJf .gpu/site.tar.xz -C /tmp/site && export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
#   mkdir -p /tmp/siteu && tar -xJf .gpu/unsloth.tar.xz -C /tmp/siteu      # then bench_train.py --unsloth-site /tmp/siteu
set -euo pipefail
pyver=3.12 host="" cuda="" unsloth=0 list=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --python) pyver=$2; shift 2 ;;
    --host-packages) host=$2; shift 2 ;;
    --cuda) cuda=$2; shift 2 ;;
    --unsloth) unsloth=1; shift ;;
    --list) list=1; shift ;;
    *) echo "gpu-site.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
plat=""
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do plat="$plat --platform $p"; done
target=(--python-version "$pyver" --implementation cp --only-binary=:all: $plat)

# name==version lines of this venv, lower-case, '_' as '-'
freeze() { python3 -m pip list --format=freeze 2>/dev/null | tr '[:upper:]_' '[:lower:]-'; }
# the host brings torch and CUDA; the project itself travels as the checkout; tracking, the UI test and linting
# are not run on a GPU host
skip='^(torch|triton|nvidia-.*|cuda-.*|pip|setuptools|wheel|qlora-pipeline|mlflow.*|selenium|ruff|databricks-sdk|trio.*)=='
pins=$(freeze | grep -vE "$skip" || true)
if [[ -n $host ]]; then  # leave out what the host already has, whatever its version
  have=$(tr '[:upper:]_' '[:lower:]-' <"$host" | sed 's/[=<> ].*//' | sort -u)
  pins=$(printf '%s\n' $pins | awk -F== 'NR==FNR{have[$1]=1; next} !($1 in have)' <(printf '%s\n' $have) -)
fi
grep -q '^liger-kernel==' <<<"$pins" || pins="$pins liger-kernel==0.8.5"  # the `gpu` extra: fused kernels on CUDA
pins="$pins py-spy"  # bench_job.py --profile
if [[ $list == 1 ]]; then printf '%s\n' $pins; exit 0; fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pack() {  # pack NAME WHEEL_DIR: install the wheels for the host's Python into a folder, then .gpu/NAME.tar.xz
  if [[ -n $cuda ]]; then
    for w in "$2"/bitsandbytes-*.whl; do
      [[ -f $w ]] || continue
      d=$(mktemp -d)
      (cd "$d" && python3 -m zipfile -e "$w" . && find bitsandbytes -name 'libbitsandbytes_*' \
         ! -name "*cuda${cuda}*" ! -name '*cpu*' -delete && rm "$w" && python3 -m zipfile -c "$w" ./*)
      rm -rf "$d"
    done
  fi
  python3 -m pip install -q --no-deps --no-compile --target "$tmp/$1" "${target[@]}" "$2"/*.whl
  mkdir -p .gpu
  XZ_OPT=-T0 tar -cJf ".gpu/$1.tar.xz" -C "$tmp/$1" .
  du -sh ".gpu/$1.tar.xz"
}

python3 -m pip download -q --no-deps -d "$tmp/whl" "${target[@]}" $pins
pack site "$tmp/whl"
if [[ $unsloth == 1 ]]; then
  # Unsloth resolves its own set (transformers <= 5.17, trl <= 1.15, datasets < 5); the host's torch stays
  python3 -m pip download -q -d "$tmp/whlu" "${target[@]}" unsloth==2026.10.9 unsloth-zoo==2026.10.9
  rm -f "$tmp"/whlu/{torch,triton,nvidia_,cuda_}*.whl
  pack unsloth "$tmp/whlu"
fi
