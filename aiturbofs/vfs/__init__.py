"""POSIX semantics on domain types: inodes, handles, reader, writer, persister."""

from ._cluster import ClusterPort as ClusterPort
from ._cluster import CopySource as CopySource
from ._cluster import PersistHints as PersistHints
from ._cluster import ReadRequest as ReadRequest
from ._cluster import Staged as Staged
from ._cluster import StageRequest as StageRequest
from ._fs import CloseReport as CloseReport
from ._fs import CloseReporter as CloseReporter
from ._fs import Filesystem as Filesystem
from ._fs import Handle as Handle
from ._options import VfsOptions as VfsOptions
