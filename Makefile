# Two commands on a fresh machine: `make run` and `make test`.
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed

.PHONY: install run test clean browser

# tests/test_ui_browser.py opens Prefect's UI in Debian's Chromium through Debian's chromedriver (as root, or
# install the two packages yourself)
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	  echo "installing Debian's chromium and chromium-driver (tests/test_ui_browser.py)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) \
	    >/tmp/chromium-install.log 2>&1 || echo "could not install them (/tmp/chromium-install.log): tests/test_ui_browser.py will fail"; \
	fi

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
# tests marked `numerics` also run on this machine's own kernels (AVX-512/AMX where it has them) and its default
# thread count. Three pytest workers, one test file each at a time: most of the suite's time is spent
# waiting on subprocesses and Prefect servers; one OpenMP thread each, so that they do not oversubscribe the cores;
# the longest files first (tests/conftest.py LONGEST_FIRST), in that order (--no-loadscope-reorder).
AVX2 := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
PYTEST := HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider
WORKERS ?= 3

# The numerics pass runs beside the AVX2 pass, not after it: the AVX2 pass leaves a core idle at times (its
# workers wait on servers and subprocesses, and its last files end unevenly), which the second pass fills. Its
# output is printed when both have ended; either failing fails `make test`. It runs in a session of its own,
# stopped with the recipe (a Ctrl-C, which it would not get as a background job, stops both). Its OpenMP threads
# sleep when they wait (OMP_WAIT_POLICY=PASSIVE; same kernels, same thread count, same numbers): by default they spin,
# and beside the AVX2 pass's workers that spinning took about as much CPU as its work (measured 11-28: 120 s of CPU
# against 65 s for four of its files with the two cores busy). Its tests use no Prefect API, so it starts no shared
# server (LORAFLOW_TESTS_PREFECT_ON_DEMAND, tests/conftest.py).
test: $(STAMP) browser
	@numerics_log=$$(mktemp); \
	setsid env OMP_WAIT_POLICY=PASSIVE LORAFLOW_TESTS_PREFECT_ON_DEMAND=1 $(PYTEST) -n 2 -m numerics --durations=10 > $$numerics_log 2>&1 & numerics=$$!; \
	trap '[ -n "$$numerics" ] && kill -TERM -$$numerics 2>/dev/null; rm -f $$numerics_log' EXIT; \
	trap 'exit 130' INT TERM; \
	echo "make test: the AVX2 pass; the numerics pass runs beside it (its output follows)"; \
	$(AVX2) OMP_NUM_THREADS=1 $(PYTEST) -n $(WORKERS) --dist loadfile --no-loadscope-reorder --durations=30; \
	avx2_rc=$$?; wait $$numerics; numerics_rc=$$?; numerics=; \
	echo "== the numerics tests on this CPU's own kernels and thread count (exit $$numerics_rc) =="; \
	cat $$numerics_log; \
	if [ $$avx2_rc -ne 0 ]; then exit $$avx2_rc; fi; exit $$numerics_rc

clean:
	rm -rf .venv outputs multirun .loraflow
