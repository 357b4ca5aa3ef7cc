"""Which FUSE data path serves the mount, and the pyfuse3 one behind the same four calls.

Both sessions serve the same ``Operations``: ``mount()``, ``await
serve(max_tasks)`` until unmounted or terminated, ``terminate()`` (stop
taking requests, let the running ones finish), ``close()`` (unmount, end
the connection).

``-o datapath=``:

* ``auto`` (default): the kernel-protocol session with passthrough where the
  kernel offers it and this process may register backing files
  (``probe_passthrough``); otherwise pyfuse3.
* ``passthrough``: that, or the mount fails saying why it cannot be had.
* ``kernel``: the kernel-protocol session with every byte through the daemon
  (no backing file handed to the kernel).
* ``pyfuse3``: libfuse through pyfuse3, the portable path (kernels before
  6.9, unprivileged containers): every byte through the daemon.
"""

from __future__ import annotations

import errno

import pyfuse3

from .._errors import ConfigError
from ._passthrough import Passthrough
from ._session import KernelSession

AUTO, PASSTHROUGH, KERNEL, PYFUSE3 = "auto", "passthrough", "kernel", "pyfuse3"
CHOICES = (AUTO, PASSTHROUGH, KERNEL, PYFUSE3)


class Pyfuse3Session:
    """pyfuse3's session (libfuse's loop, one per process) behind the calls ``KernelSession`` has."""

    name = PYFUSE3

    def __init__(self, ops, mountpoint: str, *, fsname: str, allow_other: bool, read_only: bool):
        self.ops = ops
        self.mountpoint = mountpoint
        self.options = set(pyfuse3.default_options)  # default_permissions: the kernel checks modes
        self.options |= {f"fsname={fsname}", "subtype=aiturbo"}
        if allow_other:
            self.options.add("allow_other")
        if read_only:
            self.options.add("ro")
        self._closed = True

    @staticmethod
    def counts() -> dict:
        return {}  # libfuse does not count its requests

    def mount(self) -> None:
        try:
            pyfuse3.init(self.ops, self.mountpoint, self.options)
        except RuntimeError as exc:
            raise OSError(errno.EIO, str(exc)) from None
        self._closed = False

    async def serve(self, max_tasks: int) -> None:
        await pyfuse3.main(max_tasks=max_tasks)

    def terminate(self) -> None:
        if not self._closed:  # pyfuse3.terminate() on a closed session dereferences NULL
            pyfuse3.terminate()

    def close(self, *, unmount: bool = True) -> None:
        if not self._closed:
            self._closed = True
            pyfuse3.close(unmount=unmount)


def choose(datapath: str, passthrough: Passthrough) -> tuple[str, bool]:
    """The session to run for ``-o datapath=`` and whether it hands files to the kernel; ConfigError if impossible."""
    if datapath == PYFUSE3:
        return PYFUSE3, False
    if datapath == KERNEL:
        return KERNEL, False
    if datapath == PASSTHROUGH and not passthrough.available:
        raise ConfigError(f"datapath=passthrough: this host cannot do FUSE passthrough: {passthrough.reason} "
                          "(datapath=auto falls back to pyfuse3)")
    if passthrough.available:
        return KERNEL, True
    return PYFUSE3, False


def open_session(name: str, ops, mountpoint: str, *, fsname: str, allow_other: bool, read_only: bool,
                 passthrough: bool):
    if name == PYFUSE3:
        return Pyfuse3Session(ops, mountpoint, fsname=fsname, allow_other=allow_other, read_only=read_only)
    session = KernelSession(ops, mountpoint, fsname=fsname, allow_other=allow_other, read_only=read_only,
                            passthrough=passthrough)
    ops.kernel = session
    return session
