"""DRAM staging pool and its spill tier (see ``_pool`` for the contract)."""

from ._pool import Entry as Entry
from ._pool import PoolStats as PoolStats
from ._pool import StagingPool as StagingPool
from ._spill import SpillStore as SpillStore
