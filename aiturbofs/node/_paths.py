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


def control_socket(mountpoint: str) -> str:
    return os.path.join(RUN_ROOT, mount_id(mountpoint) + ".sock")
