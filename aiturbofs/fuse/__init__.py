"""The kernel side: the request handlers, the two sessions that serve them (the kernel protocol
itself, or pyfuse3), the protocol's layouts, the passthrough probe."""

from . import _datapath as datapath  # noqa: F401 - the node picks its session here
from ._errors import fuse_handler as fuse_handler
from ._ops import Operations as Operations
from ._passthrough import Passthrough as Passthrough
from ._passthrough import probe_passthrough as probe_passthrough
from ._session import KernelSession as KernelSession
