"""What the VFS needs to know of the mount options (a plain value object)."""

from dataclasses import dataclass

from .._limits import (
    DRAIN_TIMEOUT_S_DEFAULT,
    FULL_BACKEND_WAIT_S,
    IMPORT_TTL_S,
    PERSIST_RETRY_WINDOW_S,
    PERSIST_YIELD_S,
)


@dataclass(frozen=True)
class VfsOptions:
    fsync_durable: bool = False  # -o fsync=durable
    sync_close: bool = False  # -o sync_close: close waits for future 1
    import_ttl_s: float = IMPORT_TTL_S
    persist_retry_window_s: float = PERSIST_RETRY_WINDOW_S
    persist_yield_s: float = PERSIST_YIELD_S  # -o persist_yield
    full_backend_wait_s: float = FULL_BACKEND_WAIT_S  # -o full_backend_wait
    drain_timeout_s: float = DRAIN_TIMEOUT_S_DEFAULT
    owner_uid: int = 0  # owner of objects imported from the backend
    owner_gid: int = 0
    autogroup: bool = False  # -o autogroup: untagged files read by several nodes at once form read rounds
