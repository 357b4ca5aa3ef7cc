"""The chunk store: a chunk by its key from the pool, a peer or the backend, verified (see ``_store``)."""

from ._health import BackendHealth as BackendHealth
from ._named import external_key as external_key
from ._named import external_keys as external_keys
from ._store import ChunkStore as ChunkStore
