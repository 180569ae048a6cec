#!/usr/bin/env bash
# Wheels that bench/gpu.py needs and this workplace's GPU image lacks (its Python is 3.12 with torch,
# transformers, peft, accelerate and safetensors already there). Run here, in the repository root; then
# carry .whl to the device machine and install it there first (bench/README.md has the command).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info && { grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude; }
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# Pure-Python packages, at the versions in constraints.txt (hydra/omegaconf: tasks.config, which the
# train node's setup imports).
for req in diffusers==0.42.1 hydra-core==1.3.8 omegaconf==2.3.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$req"
done
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3  # published as an sdist only
ls -l .whl
