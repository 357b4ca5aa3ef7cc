"""The pyfuse3 adapter: the only layer that knows the kernel protocol."""

from ._errors import fuse_handler as fuse_handler
from ._ops import Operations as Operations
