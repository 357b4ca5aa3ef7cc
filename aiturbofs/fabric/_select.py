"""Which transport a node's fabric runs on: the ``transport=auto|tcp|rdma`` choice, logged with its reason."""

from __future__ import annotations

import logging

from .._errors import ConfigError
from .._limits import FABRIC_IN_FLIGHT_MAX
from ._base import Transport
from ._pyverbs import probe
from ._rdma import RdmaTransport
from ._tcp import DEFAULT_PORT, TcpTransport

log = logging.getLogger("aiturbofs.fabric")

TRANSPORT_KINDS = ("auto", "tcp", "rdma")


def open_transport(kind: str, node: str, secret: bytes, *, host: str = "", port: int = DEFAULT_PORT,
                   device: str | None = None, in_flight_max: int = FABRIC_IN_FLIGHT_MAX) -> Transport:
    """The fabric transport for ``transport=kind``, unopened (use it as ``async with``).

    - ``"tcp"``: TCP.
    - ``"rdma"``: RDMA payloads over ``device`` (a name, ``NAME:PORT``, or None
      for the first device with an active port); ``ConfigError`` saying why
      when there is none or it cannot be used.
    - ``"auto"``: RDMA when a device is there and usable, TCP otherwise.

    Either way TCP carries authentication and control, and payloads to peers
    without RDMA.  The choice and its reason are logged.  ``ConfigError`` for
    an unknown ``kind``.
    """
    if kind not in TRANSPORT_KINDS:
        raise ConfigError(f"transport={kind}: want one of {', '.join(TRANSPORT_KINDS)}")

    def tcp() -> TcpTransport:
        return TcpTransport(node, secret, host=host, port=port, in_flight_max=in_flight_max)

    if kind == "tcp":
        log.info("fabric: TCP transport (transport=tcp)")
        return tcp()
    devices, why = probe()
    if device is not None and device.partition(":")[0] not in devices:
        why = f"RDMA device {device!r} is not among the usable ones ({', '.join(devices) or why})"
        devices = []
    if not devices:
        if kind == "rdma":
            raise ConfigError(f"transport=rdma: {why}; see docs/rdma.md, or use transport=auto to fall back to TCP")
        log.info("fabric: TCP transport (transport=auto): %s", why)
        return tcp()
    try:
        transport = RdmaTransport(node, secret, host=host, port=port, device=device or devices[0], in_flight_max=in_flight_max)
    except ConfigError as e:
        if kind == "rdma":
            raise ConfigError(f"transport=rdma: {e}") from None
        log.warning("fabric: TCP transport (transport=auto): RDMA device %s is there but cannot be used: %s", device or devices[0], e)
        return tcp()
    log.info("fabric: RDMA transport on %s (transport=%s); TCP for authentication, control, and peers without RDMA",
             transport.device_name, kind)
    return transport
