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

run: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m flows.train

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider

clean:
	rm -rf .venv outputs multirun .loraflow
