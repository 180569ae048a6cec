"""`python -m flows.worker --pool loraflow-pool --type process`: `prefect worker start` with the same
arguments, after checking that the server accepts this client's PREFECT_API_AUTH_STRING (one line and
exit 2 if not, where `prefect worker start` alone ends in a traceback)."""
from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    from flows.auth import stop_on_auth_failure

    stop_on_auth_failure()
    prefect = str(Path(sys.executable).with_name("prefect"))
    os.execv(prefect, [prefect, "worker", "start", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
