"""`loraflow`, the console script: `python -m flows.train`'s start-up. No garbage collection while the CLI's
modules import, then the objects they made (~140,000, alive until exit) are frozen, so no later collection
walks them (a no-op run: 0.4 s less on 2 cores; bench/RESULTS.md figure 6)."""
from __future__ import annotations

import gc


def main() -> None:
    gc.disable()
    from flows.cli import main as cli_main

    gc.freeze()
    gc.enable()
    cli_main()
