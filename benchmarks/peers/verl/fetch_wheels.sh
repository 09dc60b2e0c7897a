#!/bin/bash
# The wheels verl 0.9.1 needs beyond what the GPU host and its carried SGLang 0.5.17 site have (3.6 MB, cp312),
# into REPO/.gpu-verl/ (ignored by git: '/.gpu-*/'); Ray 2.60 comes from .gpu-ray1/.gpu-ray2 (build_carry.sh).
# Run where pip reaches PyPI:  bash benchmarks/peers/verl/fetch_wheels.sh [REPO=.]
# Install on the host with --no-deps (verl's metadata wants transformers<5.11; the host has 5.17, which no import
# checks): python3 -m venv --system-site-packages <venv> && <venv>/bin/pip install --no-deps --no-index
# .gpu-verl/*.whl (or pip install --no-deps --target <dir>, put first on PYTHONPATH, as the first attempt did)
set -euo pipefail
OUT=$(cd "${1:-.}" && pwd)/.gpu-verl
mkdir -p "$OUT"
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d "$OUT" \
  verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 cloudpickle==3.1.3 transferqueue==0.1.11 hydra-core==1.3.8 \
  omegaconf==2.3.0 codetiming==1.4.0 torchdata==0.11.0 pylatexenc==2.11 msgpack==1.2.4 cachetools==7.3.3
python3 -m pip wheel -q --no-deps -w "$OUT" antlr4-python3-runtime==4.9.3  # no wheel on PyPI: built from its sdist
(cd "$OUT" && sha256sum ./*.whl >SHA256SUMS)
du -sh "$OUT"
