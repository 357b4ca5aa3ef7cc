"""The kernel side: the pyfuse3 adapter, the kernel protocol's layouts, the passthrough probe."""

from ._errors import fuse_handler as fuse_handler
from ._ops import Operations as Operations
from ._passthrough import Passthrough as Passthrough
from ._passthrough import probe_passthrough as probe_passthrough
