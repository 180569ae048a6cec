#!/usr/bin/env bash
# One lent GPU's runs for issue 34, as one command on the device machine (bench/README.md): install the
# wheels bench/gpu_wheels.sh put in .whl/, then every family's DAG through the CLI (bench.gpu_families), then bench.gpu (FLUX.1-dev
# figures, side by side with bare loops). Results go to $OUT (default /tmp/gpu_out).
# Budgets in seconds: SPEED_S (bench.gpu_speed: issue 45's settings), MATMUL_S (bench.gpu_matmul), MUSUBI_S (bench.musubi_side), MEMORY_S (bench.memory_gpu:
# bench.memory's image-to-video rows, issue 47 item 5), BENCH_S (bench.gpu), FAMILIES_S (bench.gpu_families' --deadline);
# extra arguments in SPEED_ARGS / MEMORY_ARGS / BENCH_ARGS / FAMILY_ARGS. STEPS: which parts run, in this order
# (default "speed matmul musubi memory families bench"; e.g. STEPS=memory for the memory rows alone).
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "installing .whl failed"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, transformers, diffusers, peft, prefect, bitsandbytes; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), '| transformers', transformers.__version__, 'diffusers', diffusers.__version__, 'peft', peft.__version__, 'prefect', prefect.__version__, 'bitsandbytes', bitsandbytes.__version__)"
STEPS=" ${STEPS:-speed matmul musubi memory families bench} "
runs() { [[ "$STEPS" == *" $1 "* ]]; }
# issue 45's speed figures first (the standing order): every setting against bf16 in one process
# (the settings auto runs first: the W8A8 rows are opt-in paths, measured slower on an H200; bench/README.md)
SPEED_ONLY=${SPEED_ONLY:-bf16,fp8,int8,nf4+bnb,int8+swap10,bf16+compile,int8+compile,fp8+w8a8,int8+w8a8,nf4}
runs speed && timeout -k 10 "${SPEED_S:-300}" python3 -m bench.gpu_speed --only "$SPEED_ONLY" --steps 3 \
  --budget "$(( ${SPEED_S:-300} - 70 ))" --out "$OUT/gpu_speed.json" ${SPEED_ARGS:-} 2>&1 | tee "$OUT/gpu_speed.log"
# where the matmul paths' time goes, per Linear (the fallback's weight casts too): about a minute
runs matmul && timeout -k 10 "${MATMUL_S:-150}" python3 -m bench.gpu_matmul --out "$OUT/gpu_matmul.json" 2>&1 \
  | tee "$OUT/gpu_matmul.log"
# issue 45 item 4: musubi-tuner's own step beside loraflow's (its source: bench/third_party/musubi_tuner)
runs musubi && for fam in ${MUSUBI_FAMILIES:-qwenimage}; do
  timeout -k 10 "${MUSUBI_S:-300}" python3 -m bench.musubi_side --family "$fam" --rounds "${MUSUBI_ROUNDS:-2}" \
    --budget "$(( ${MUSUBI_S:-300} - 60 ))" --out "$OUT/musubi_side_$fam.json" ${MUSUBI_ARGS:-} 2>&1 | tee "$OUT/musubi_side_$fam.log"
done
# issue 47 item 5: bench.memory's image-to-video rows on the GPU (max_memory_allocated beside the CPU peak and the
# preflight), each model's 24 GB setting first, a row in its own process; merge here: python -m bench.memory_gpu --merge FILE
runs memory && timeout -k 10 "$(( ${MEMORY_S:-300} + 30 ))" python3 -m bench.memory_gpu --budget "${MEMORY_S:-300}" \
  --out "$OUT/memory_gpu.json" ${MEMORY_ARGS:-} 2>&1 | tee "$OUT/memory_gpu.log"
runs families && python3 -m bench.gpu_families --jobs "${JOBS:-8}" --deadline "${FAMILIES_S:-200}" --work /tmp/gpu_families \
  --out "$OUT/gpu_families.json" --logs "$OUT/gpu_families_failures.txt" ${FAMILY_ARGS:-} 2>&1 | tee "$OUT/gpu_families.log"
# bench.gpu merges the families' verdicts into gpu_results.json (contract.md: its `families`)
runs bench && timeout -k 10 "${BENCH_S:-300}" python3 -m bench.gpu --budget "${BENCH_S:-300}" --families "$OUT/gpu_families.json" \
  --out "$OUT/gpu_results.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/gpu_bench.log"
# the speed figures join gpu_results.json's `figures` (contract.md)
for f in "$OUT/gpu_speed.json" "$OUT"/musubi_side_*.json; do
  [ -f "$f" ] && python3 -c "import sys; from bench.gpu_speed import merge; merge(sys.argv[1], sys.argv[2])" \
    "$f" "$OUT/gpu_results.json"
done
echo "session done"
