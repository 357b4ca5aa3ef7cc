"""The metadata engine: namespace, manifests, durability states, xattrs, and
for cluster mode the members and the index of chunks already in the backend.

``open_meta(url)`` picks the engine by URL scheme; engines are imported
lazily so that a node without a PostgreSQL driver still runs on SQLite.
This package imports nothing of the filesystem but ``_limits`` and ``_errors``.
"""

import importlib

from .. import _errors
from ._base import INHERIT_XATTR_PREFIX as INHERIT_XATTR_PREFIX
from ._base import NODE_ALIVE as NODE_ALIVE
from ._base import NODE_DEAD as NODE_DEAD
from ._base import NODE_LEFT as NODE_LEFT
from ._base import NODE_STATES as NODE_STATES
from ._base import ROOT_INO as ROOT_INO
from ._base import STATE_BROKEN as STATE_BROKEN
from ._base import STATE_DURABLE as STATE_DURABLE
from ._base import STATE_PERSISTING as STATE_PERSISTING
from ._base import STATE_STAGED as STATE_STAGED
from ._base import STATE_XATTR as STATE_XATTR
from ._base import STATES as STATES
from ._base import ChunkSource as ChunkSource
from ._base import InodeRow as InodeRow
from ._base import MetaStore as MetaStore
from ._base import NodeRow as NodeRow

# URL scheme -> module (in this package) whose from_url(url) builds the store.
_ENGINES = {
    "sqlite": "._sqlite",
    "postgresql": "._postgres",
    "postgres": "._postgres",
}


def open_meta(url: str) -> MetaStore:
    """A store for ``url`` (e.g. ``sqlite:///abs/path.db``), not yet opened.

    Call ``await store.init(...)`` before anything else.  Raises
    ``ConfigError`` for an unknown scheme or a malformed URL.
    """
    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in _ENGINES:
        known = ", ".join(f"{name}://" for name in _ENGINES)
        raise _errors.ConfigError(f"metadata URL {url!r}: unknown engine (known: {known})")
    try:
        module = importlib.import_module(_ENGINES[scheme], __name__)
    except ImportError as exc:
        raise _errors.missing_extra(f"the {scheme}:// metadata engine", "cluster", exc) from exc
    return module.from_url(url)
