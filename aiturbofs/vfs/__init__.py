"""POSIX semantics on domain types: inodes, handles, reader, writer, persister."""

from ._fs import Filesystem as Filesystem
from ._inodes import Handle as Handle
from ._local_side import VfsLocalSide as VfsLocalSide
from ._options import VfsOptions as VfsOptions
from ._state_waits import StateWatcher as StateWatcher
