"""The node-side cluster data plane: replicas, holds, read chains, takeover; and the port the VFS talks to."""

from ._node import ClusterNode as ClusterNode
from ._port import CloseReport as CloseReport
from ._port import CloseReporter as CloseReporter
from ._port import ClusterPort as ClusterPort
from ._port import CopySource as CopySource
from ._port import LocalSide as LocalSide
from ._port import PersistHints as PersistHints
from ._port import ReadRequest as ReadRequest
from ._port import SingleNode as SingleNode
from ._port import Staged as Staged
from ._port import StageRequest as StageRequest
