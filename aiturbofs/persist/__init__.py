"""Future 1: the persist queue, the reconciler, upload jobs and recovery (see ``_queue``)."""

from ._host import PersistHost as PersistHost
from ._host import PersistStats as PersistStats
from ._queue import Persister as Persister
