import os

# Our modules log to "loraflow"; let Prefect show those lines in its console and UI.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "loraflow")
