"""store.rehash=true (issue 18, item 9): big files' digests are memoised by path, size, mtime and inode (DVC's
trade-off: an in-place rewrite that keeps all four keeps the old digest); rehash digests them again and
rewrites the memo."""
from __future__ import annotations

import os

from tasks.config_schema import StoreConfig
from tasks.store.hashing import digest_file
from tasks.store.remote_store import open_store


def test_rehash_redigests_a_file_the_memo_would_misname(tmp_path):
    f = tmp_path / "weights.safetensors"
    f.write_bytes(b"a" * 4096)
    st = os.stat(f)
    old = open_store(StoreConfig(root=str(tmp_path / "store"))).file_digest(f, min_size=1)
    with open(f, "r+b") as fh:  # same inode, same size, mtime restored
        fh.write(b"b" * 4096)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert open_store(StoreConfig(root=str(tmp_path / "store"))).file_digest(f, min_size=1) == old  # the trade-off
    new = open_store(StoreConfig(root=str(tmp_path / "store"), rehash=True)).file_digest(f, min_size=1)
    assert new == digest_file(f) != old
    # the memo was rewritten: a run without rehash now sees the new digest too
    assert open_store(StoreConfig(root=str(tmp_path / "store"))).file_digest(f, min_size=1) == new
