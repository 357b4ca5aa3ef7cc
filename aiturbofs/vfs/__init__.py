"""POSIX semantics on domain types: inodes, handles, reader, writer, persister."""

from ._fs import CloseReport as CloseReport
from ._fs import CloseReporter as CloseReporter
from ._fs import Filesystem as Filesystem
from ._fs import Handle as Handle
from ._options import VfsOptions as VfsOptions
