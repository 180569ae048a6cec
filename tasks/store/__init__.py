"""Content-addressed entries (`Store`), their keys (hashing), file formats and bookkeeping: the index of
entries, file digests, debris of killed writers, repairs, and fsspec stores (remote_store).

Imports nothing else of the project but tasks.lazy: everything above stores through it. `from tasks.store
import Store` is the usual entry point."""
from tasks.store.repairs import track_repairs
from tasks.store.store import MANIFEST, CorruptArtifact, Store, StoreBackendMissing, StoreFull

# Public from here: errors name themselves tasks.store.<Name>, as users (and their logs) have always seen them.
for _cls in (CorruptArtifact, Store, StoreBackendMissing, StoreFull):
    _cls.__module__ = __name__

__all__ = ["MANIFEST", "CorruptArtifact", "Store", "StoreBackendMissing", "StoreFull", "track_repairs"]
