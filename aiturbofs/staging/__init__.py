"""Staging: backing files, the chunk pool over them, and the spill tier (see ``_pool``)."""

from ._backing import BackingArea as BackingArea
from ._backing import BackingFile as BackingFile
from ._backing import Range as Range
from ._backing import content_key_of as content_key_of
from ._backing import is_hole as is_hole
from ._backing import punch_hole as punch_hole
from ._entry import Entry as Entry
from ._pool import Pins as Pins
from ._pool import PoolStats as PoolStats
from ._pool import StagingPool as StagingPool
from ._pool import room as room
from ._pool import room_in as room_in
from ._spill import SPILL_FILES_DIR as SPILL_FILES_DIR
from ._spill import SpillStore as SpillStore
