"""Object storage behind one small interface (see ``_base``).

Implementations are registered by URL scheme and imported only when used,
so a missing optional package (s3fs) matters only to the mounts that need
it.  This layer imports nothing of the filesystem above it except
``aiturbofs._limits`` and ``aiturbofs._errors``.
"""

from __future__ import annotations

import importlib
from typing import Any

from .._errors import ConfigError
from ._base import ASIDE_PREFIX as ASIDE_PREFIX
from ._base import UPLOAD_TEMP_PREFIX as UPLOAD_TEMP_PREFIX
from ._base import Backend as Backend
from ._base import NodeAttrs as NodeAttrs
from ._base import ObjectInfo as ObjectInfo
from ._base import Upload as Upload
from ._base import check_key as check_key

# scheme -> (module, class, what to install if the import fails)
_IMPLEMENTATIONS = {
    "file": ("._local", "LocalBackend", None),
    "s3": ("._s3", "S3Backend", "pip install s3fs"),
}
# Every other scheme: whatever fsspec knows (memory://, gcs://, ...).
_FALLBACK = ("._fsspec", "FsspecBackend", "pip install fsspec")


async def open_backend(url: str, options: dict[str, Any] | None = None, *, check: bool = True) -> Backend:
    """Open the backend for ``url`` (``file:///abs``, ``/abs``, ``s3://bucket/prefix``, any fsspec URL).

    ``options`` are per-scheme (see each implementation's docstring); an
    option that does not apply raises ``ConfigError``, as do an unusable URL
    and a missing package (with an install hint).  Raises ``BackendError``
    if the storage refuses (missing bucket, unusable root) and
    ``TransientBackendError`` if it does not answer.  ``check=False``: only
    the URL and options are checked; ``Backend.check`` asks the storage later.
    """
    scheme = _scheme(url)
    module_name, class_name, hint = _IMPLEMENTATIONS.get(scheme, _FALLBACK)
    try:
        module = importlib.import_module(module_name, __package__)
    except ImportError as e:
        raise ConfigError(f"backend {scheme}:// needs a package that is missing ({e}): {hint}") from e
    return await getattr(module, class_name).open(url, dict(options or {}), check=check)


def _scheme(url: str) -> str:
    if url.startswith("/"):
        return "file"
    scheme, sep, _ = url.partition("://")
    if not sep or not scheme:
        raise ConfigError(f"backend {url!r}: want an absolute path or a URL like file:///path or s3://bucket")
    return scheme.lower()
