#!/bin/bash
# The whole job (bench_job.py) under two sets of libraries in one call, after the card's matmul rate: transformers
# 5.24.0 + peft 0.21.0 (with the image's huggingface_hub 1.33) against this venv's (2026-12-04: transformers 5.25.0,
# peft 0.21.2, huggingface_hub 2.4.0); same code, same model. bench/README.md, "Issue 24, ninth pass".
# here (repository root, venv active): bench/gpu-site.sh, then the older pair, 4.8 MiB:
#   pip download --no-deps --only-binary=:all: -d /tmp/old/whl transformers==5.24.0 peft==0.21.0
#   pip install --no-deps --target /tmp/old/site --python-version 3.12 --implementation cp --only-binary=:all: /tmp/old/whl/*.whl
#   tar -cJf .gpu/old-libs.tar.xz -C /tmp/old/site .
# on the GPU host (`.gpu` and `.shared_bench` carried): bash bench/job_libs_ab.sh
set -e
mkdir -p /tmp/site && tar -xJf .gpu/site.tar.xz -C /tmp/site
rm -rf /tmp/site524 && cp -a /tmp/site /tmp/site524 && rm -rf /tmp/site524/transformers* /tmp/site524/huggingface_hub* /tmp/site524/peft*
tar -xJf .gpu/old-libs.tar.xz -C /tmp/site524
export PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv
PYTHONPATH=$PWD:/tmp/site python3 -c "import sys; sys.path.insert(0, 'bench'); from bench_train import worker_matmul; print('matmul', worker_matmul({}))"
for s in site524 site; do
  PYTHONPATH=$PWD:/tmp/$s python3 -c "import transformers, peft, huggingface_hub as h; print('$s', transformers.__version__, peft.__version__, h.__version__)"
  date -u
  PYTHONPATH=$PWD:/tmp/$s python3 bench/bench_job.py --shared .shared_bench --dolly .shared_bench/dolly_open_qa.jsonl --model /tmp/job8b --work /tmp/qj-$s --out $OUT/job-$s.json 2>&1 | grep -v "Writing model" | tail -3
  rm -rf /tmp/qj-$s; sync
done
date -u
