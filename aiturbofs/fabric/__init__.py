"""The peer data plane: chunks and control messages between authenticated nodes.

``Transport`` (see ``_base``) is the interface; ``TcpTransport`` runs
everywhere, ``RdmaTransport`` moves chunk payloads over RC queue pairs
(pyverbs) where both peers have RDMA, ``MemoryTransport`` serves unit tests.
``open_transport(kind, ...)`` makes the one a node asked for (``auto``,
``tcp``, ``rdma``) and logs why; ``rdma_devices()`` says what is there.
Peers prove knowledge of the cluster secret (``load_secret``) before any
request is read.  This layer imports only ``_limits``, ``_errors`` and
``chunk`` — never vfs, staging or the controller.
"""

from ._auth import load_secret as load_secret
from ._base import ChunkHandler as ChunkHandler
from ._base import Named as Named
from ._base import Peer as Peer
from ._base import PeerCounters as PeerCounters
from ._base import PeerInfo as PeerInfo
from ._base import Transport as Transport
from ._loopverbs import LoopbackDevice as LoopbackDevice
from ._memory import MemoryNetwork as MemoryNetwork
from ._memory import MemoryTransport as MemoryTransport
from ._pyverbs import rdma_devices as rdma_devices
from ._rdma import RdmaTransport as RdmaTransport
from ._select import TRANSPORT_KINDS as TRANSPORT_KINDS
from ._select import open_transport as open_transport
from ._tcp import TcpTransport as TcpTransport
from ._tcp import format_address as format_address
from ._tcp import parse_address as parse_address
