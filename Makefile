# Two commands on a fresh machine: `make run` and `make test`.
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed

.PHONY: install run test clean

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	# The CPU torch wheel first, pinned: an unpinned torch pulls GBs of CUDA packages.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The demo: a LoRA teaches the pretrained demo base a new shape; samples/before_after.png shows it (docs/learning.md)
run: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m flows.train experiment=demo

# The suite runs on the AVX2 kernels whatever this CPU has (torch's ATen, oneDNN and MKL each pick kernels by CPU
# features): its numbers must hold on an AVX2-only CPU, the commonest in the cloud, not just on this one. The
# tests marked `numerics` then run once more on this machine's own kernels (AVX-512/AMX where it has them) and
# its default thread count. Three pytest workers, one test file each at a time: most of the suite's time is spent
# waiting on subprocesses and Prefect servers; one OpenMP thread each, so that they do not oversubscribe the cores;
# the longest files first (tests/conftest.py LONGEST_FIRST), in that order (--no-loadscope-reorder).
AVX2 := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
PYTEST := HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider
WORKERS ?= 3

test: $(STAMP)
	$(AVX2) OMP_NUM_THREADS=1 $(PYTEST) -n $(WORKERS) --dist loadfile --no-loadscope-reorder --durations=30
	$(PYTEST) -n 2 -m numerics --durations=10

clean:
	rm -rf .venv outputs multirun .loraflow
