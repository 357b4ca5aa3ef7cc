"""Where a mount keeps its local state (and, from ``_control_client``, where its control socket is)."""

import os

import blake3

from .._control_client import RUN_ROOT as RUN_ROOT
from .._control_client import control_socket as control_socket
from .._control_client import mount_id

STATE_ROOT = "/var/lib/aiturbo"


def default_state_dir(mountpoint: str) -> str:
    return os.path.join(STATE_ROOT, mount_id(mountpoint))


DRAM_ROOT = "/dev/shm"


def default_staging_dir(state_dir: str) -> str:
    """Where the backing files live: on the DRAM tmpfs, one directory per state dir.

    Named after the state dir, so a restart finds what a crashed run left;
    without a /dev/shm, in the state dir itself.
    """
    if not os.path.isdir(DRAM_ROOT):
        return os.path.join(state_dir, "staging")
    digest = blake3.blake3(os.path.abspath(state_dir).encode()).hexdigest()[:16]
    return os.path.join(DRAM_ROOT, "aiturbofs", digest)
