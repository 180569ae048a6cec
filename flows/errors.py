"""The errors that are the user's to fix (a bad config key, a bad dataset, a missing file, a full disk): the
CLI prints their message in one line and exits 2, Prefect's log shows no traceback for them, a sweep lists
the member as failed. One tuple, imported by everything that handles them."""
from __future__ import annotations

from tasks.config import ConfigError
from tasks.data.dataset import DatasetError
from tasks.store import StoreBackendMissing, StoreFull

USER_ERRORS = (ConfigError, DatasetError, FileNotFoundError, StoreFull, StoreBackendMissing)
