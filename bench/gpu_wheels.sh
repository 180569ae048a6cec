#!/usr/bin/env bash
# Wheels that bench/gpu_session.sh needs on this workplace's GPU image (Python 3.12 with torch, transformers,
# tokenizers, huggingface_hub, accelerate, safetensors, numpy, pillow ... already there: the device tool's
# KINDS.md lists them). Run here, in the repository root; then carry .whl to the device machine (bench/README.md).
# Everything fits the device tool's 64 MiB with the working tree: bitsandbytes is slimmed to its CUDA 13.0
# library (the image's torch is cu130), torchao to its Python code, and antlr4 (an sdist only) is built here.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
mkdir -p .git/info && { grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude; }
rm -rf .whl && mkdir .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 manylinux_2_5_x86_64; do
  platforms+=(--platform "$p")
done
grep -v '^#' bench/gpu_requirements.txt | python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl -r /dev/stdin
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_24_x86_64 \
  -d "$tmp" bitsandbytes==0.50.2
(cd "$tmp" && mkdir x && cd x && unzip -q ../bitsandbytes-*.whl \
  && find bitsandbytes -name 'libbitsandbytes_*.so' ! -name '*_cuda130.so' ! -name '*_cpu.so' -delete \
  && zip -qr "$root/.whl/bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl" .)
rm -rf "$tmp"
# torchao (model.quantize=int8|nf4): loraflow uses its Python tensors (Int8Tensor, NF4Tensor) only; its CUDA
# extension libraries (40 MB) are left out so .whl still fits
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  -d "$tmp" torchao==0.18.0
(cd "$tmp" && mkdir x && cd x && unzip -q ../torchao-*.whl && find torchao -name '*.so' -delete \
  && zip -qr "$root/.whl/torchao-0.18.0-cp310-abi3-manylinux_2_28_x86_64.whl" .)
rm -rf "$tmp"
du -sh .whl
