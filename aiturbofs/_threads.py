"""Worker-thread helpers shared by every layer.

``background(fn, *args)`` runs ``fn`` at a lower CPU priority (nice
``BACKGROUND_NICE``) on the calling worker thread and restores the priority
afterwards.  Hashing, buffer warming, spilling and uploads use it: on a
small host they compete with the FUSE thread for cores, and the FUSE thread
is what the writer waits for.
"""

import os
import threading

from ._limits import BACKGROUND_NICE


def background(fn, *args):
    """Call ``fn(*args)`` with this thread's nice value raised; returns its result."""
    tid = threading.get_native_id()
    try:
        old = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
    except OSError:
        old = None
    try:
        return fn(*args)
    finally:
        if old is not None:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, old)
            except OSError:
                pass  # lowering nice needs CAP_SYS_NICE: the thread stays nice
