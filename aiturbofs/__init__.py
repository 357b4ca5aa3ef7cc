"""aiturbofs: a FUSE filesystem that makes cloud storage fast for AI jobs.

From Python, over a mount (see README.md, "From Python"):
``aiturbofs.wait(paths, timeout=None)`` blocks until the files are durable in
the backend (future 1); ``aiturbofs.states(paths)`` says where each one is
now.  Importing the package loads neither the daemon nor trio.
"""

from ._wait import BROKEN as BROKEN
from ._wait import DURABLE as DURABLE
from ._wait import PERSISTING as PERSISTING
from ._wait import STAGED as STAGED
from ._wait import BrokenFiles as BrokenFiles
from ._wait import NotDurable as NotDurable
from ._wait import WaitTimeout as WaitTimeout
from ._wait import states as states
from ._wait import wait as wait


def __getattr__(name: str) -> str:
    if name == "__version__":  # read from the installed metadata only when asked (``_version``)
        from ._version import version

        return version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
