"""The Prefect side: the flow (train.py: the DAG), its @task shells (nodes.py), the Hydra CLI (cli.py), the Dask
runner (runner.py, shards.py), sweeps, artifacts, logs, signals and exit codes. Imports tasks/; tasks/ never
imports it (tests/test_imports.py). Importing this package sets Prefect's defaults below."""
import os

# Our modules log to "loraflow"; let Prefect show those lines in its console and UI.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "loraflow")

# The temporary local API (no PREFECT_API_URL) keeps its state in SQLite. Prefect's start-up telemetry
# writes to it while migrations run, which under load fails with "database is locked" (and phones home,
# which these machines cannot); a longer statement timeout rides out busy moments.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_DATABASE_TIMEOUT", "60")

# Quiet by default: transformers' and diffusers' warnings a loraflow user cannot act on (torchvision
# fallbacks, "No LoRA keys associated to ...") and their loading/saving progress bars. LORAFLOW_VERBOSE=1
# brings them back.
if os.environ.get("LORAFLOW_VERBOSE", "0") in ("", "0"):
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "error")  # runner=dask: the cluster's start/stop chatter
