"""Where a mount keeps its local state and its control socket."""

import os

import blake3

STATE_ROOT = "/var/lib/aiturbo"
RUN_ROOT = "/run/aiturbo"


def mount_id(mountpoint: str) -> str:
    """A stable, readable, collision-free name for a mount point."""
    path = os.path.abspath(mountpoint)
    readable = path.strip("/").replace("/", "-")[-48:] or "root"
    return f"{readable}-{blake3.blake3(path.encode()).hexdigest()[:8]}"


def default_state_dir(mountpoint: str) -> str:
    return os.path.join(STATE_ROOT, mount_id(mountpoint))


def control_socket(mountpoint: str) -> str:
    return os.path.join(RUN_ROOT, mount_id(mountpoint) + ".sock")
