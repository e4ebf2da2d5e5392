#!/usr/bin/env bash
# The wheels the GPU machine lacks (Python 3.12, x86-64; it has torch, Triton, numpy, but no
# FastAPI stack, no FLA and no py-spy), downloaded into .whl/ (ignored by git) for the device tool's `carry`.
# bench/gpu_serve.sh and the K3 GPU tests install them into /tmp/site there.
#
#   bash bench/gpu_wheels.sh        # once, on the machine that sends device runs (needs PyPI)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  fla-core==0.6.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 annotated-doc==0.0.7 typing-extensions==4.16.0 typing-inspection==0.4.5 anyio==4.16.0 \
  sniffio==1.3.1 h11==0.16.0 httpx==0.29.0 httpcore==1.0.9 idna==3.20 opentelemetry-api==1.45.2 \
  py-spy==0.4.3  # bench/serve.py --py-spy: where the server processes' time goes
# uvicorn's standard extras, only for gpu_check.sh serve_std (a subfolder: every run installs .whl/*.whl)
mkdir -p .whl/std
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl/std \
  uvloop==0.23.0 httptools==0.9.0
du -sh .whl
