"""What a flow run repaired: every corrupt entry, run record, index shard or digest memo the store discards
is noted here, for the report's `repaired` list. One list per context (a flow run and the tasks it calls)."""
from __future__ import annotations

from contextvars import ContextVar

_REPAIRS: ContextVar[list[str] | None] = ContextVar("loraflow_repairs", default=None)


def track_repairs() -> list[str]:
    """From now on in this context (a flow run and the tasks it calls), every corrupt entry, run record or
    digest memo that is discarded is appended to the returned list as "kind/key"."""
    repairs: list[str] = []
    _REPAIRS.set(repairs)
    return repairs


def note_repair(what: str) -> None:
    repairs = _REPAIRS.get()
    if repairs is not None and what not in repairs:
        repairs.append(what)
