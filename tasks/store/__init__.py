"""Content-addressed entries (`Store`), their keys (hashing), file formats and bookkeeping: the index of
entries, file digests, debris of killed writers, and fsspec stores (remote_store). `from tasks.store import
Store` is the usual entry point."""
from tasks.store.store import MANIFEST, CorruptArtifact, Store, StoreFull, track_repairs

# Public from here: errors name themselves tasks.store.<Name>, as users (and their logs) have always seen them.
for _cls in (CorruptArtifact, Store, StoreFull):
    _cls.__module__ = __name__

__all__ = ["MANIFEST", "CorruptArtifact", "Store", "StoreFull", "track_repairs"]
