"""loraflow benchmarks (not part of the test suite): `python -m bench.run` on the CPU, `python -m bench.gpu` on a GPU."""
