"""The verbs seam on a real port (a NIC, or soft-RoCE), through pyverbs.

pyverbs is rdma-core's Python binding: Debian's ``python3-pyverbs``, or
PyPI's ``pyverbs`` where the installed libibverbs is of the same rdma-core
release.  It is imported lazily: without it, or without a device,
``rdma_devices()`` is empty and nothing else here runs.  This is the only
module that imports pyverbs, and the one place its exceptions become
``VerbsError``.

Registered memory is an anonymous mmap registered by address, so the
transport reads and writes it through a memoryview with no extra copy.
Completions wait on the completion channel's file descriptor where pyverbs
exposes it (``CompChannel.fd``, newer rdma-core); older pyverbs (Debian 12's
rdma-core 44) has none, and the transport polls from a worker thread.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .._limits import (
    FABRIC_RDMA_ACK_TIMEOUT,
    FABRIC_RDMA_GIDS_MAX,
    FABRIC_RDMA_HOP_LIMIT,
    FABRIC_RDMA_MIN_RNR_TIMER,
    FABRIC_RDMA_POLL_BATCH,
    FABRIC_RDMA_POLL_SLEEP_S,
    FABRIC_RDMA_READS_MAX,
    FABRIC_RDMA_RETRY_COUNT,
    FABRIC_RDMA_RNR_RETRY,
)
from ._verbs import Completion, Device, Op, QpAddress, QueuePair, Region, VerbsError

log = logging.getLogger("aiturbofs.fabric")

INSTALL_HINT = "apt-get install python3-pyverbs (see docs/rdma.md)"


@contextmanager
def _verbs_errors(what: str) -> Iterator[None]:
    """pyverbs' exceptions (PyverbsError and kin) become ``VerbsError`` here, and only here."""
    try:
        yield
    except VerbsError:
        raise
    except Exception as e:  # PyverbsError and kin, TypeError/ValueError on bad args: all mapped
        raise VerbsError(f"{what}: {e}") from e


def load():
    """The pyverbs modules used here; ``VerbsError`` saying why they cannot be had."""
    try:
        from pyverbs import addr, cq, device, enums, mr, pd, qp, wr
    except ModuleNotFoundError as e:
        raise VerbsError(f"pyverbs is not installed ({e}); {INSTALL_HINT}") from None
    except Exception as e:  # noqa: BLE001 - e.g. PyPI's pyverbs on an older libibverbs: "IBVERBS_PRIVATE_59 not found"
        raise VerbsError(
            f"pyverbs does not load ({e}); it must come from the same rdma-core release as libibverbs: {INSTALL_HINT}"
        ) from None
    return addr, cq, device, enums, mr, pd, qp, wr


def probe() -> tuple[list[str], str]:
    """``(names of RDMA devices with an active port, why there are none)``; never raises."""
    try:
        _, _, device, enums, *_ = load()
    except VerbsError as e:
        return [], str(e)
    if not os.path.isdir("/sys/class/infiniband"):
        return [], "no RDMA device (no /sys/class/infiniband: no RDMA driver is loaded)"
    try:
        found = device.get_device_list()
    except Exception as e:  # noqa: BLE001 - a kernel without its RDMA subsystem
        return [], f"no RDMA device ({e})"
    names: list[str] = []
    down: list[str] = []
    for dev in found:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        try:
            ctx = device.Context(name=name)
            try:
                ports = ctx.query_device().phys_port_cnt
                active = any(ctx.query_port(p).state == enums.ibv_port_state.IBV_PORT_ACTIVE for p in range(1, ports + 1))
            finally:
                ctx.close()
        except Exception as e:  # noqa: BLE001 - one unusable device must not hide the others
            down.append(f"{name} ({e})")
            continue
        (names if active else down).append(name)
    if names:
        return names, ""
    if down:
        return [], f"no RDMA device has an active port ({', '.join(down)})"
    return [], "no RDMA device"


def rdma_devices() -> list[str]:
    """Names of the RDMA devices with an active port; empty without pyverbs or devices.  Never raises."""
    try:
        return probe()[0]
    except Exception:  # noqa: BLE001 - a broken binding must not stop a node that can use TCP
        return []


def _gid_bytes(gid) -> bytes:
    return bytes.fromhex(gid.gid.replace(":", ""))


def _gid_text(raw: bytes) -> str:
    return ":".join(raw[i : i + 2].hex() for i in range(0, 16, 2))


# --- pyverbs objects, built apart from any device (so tests can check them against the bindings) ---


def init_attrs(mods, cq, *, port: int, send_depth: int, remote_access: bool):
    """``(QPInitAttr, QPAttr)`` of an RC queue pair in INIT with the given access rights."""
    _, _, _, e, _, _, qp_mod, _ = mods
    cap = qp_mod.QPCap(max_send_wr=send_depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    init = qp_mod.QPInitAttr(qp_type=e.ibv_qp_type.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=1)
    attr = qp_mod.QPAttr(port_num=port)
    access = e.ibv_access_flags.IBV_ACCESS_LOCAL_WRITE
    if remote_access:
        access |= e.ibv_access_flags.IBV_ACCESS_REMOTE_READ | e.ibv_access_flags.IBV_ACCESS_REMOTE_WRITE
    attr.qp_access_flags = access
    attr.pkey_index = 0
    return init, attr


def rts_attr(mods, *, port: int, ethernet: bool, gid_index: int, local: QpAddress, remote: QpAddress, rd_atomic_out: int):
    """The ``QPAttr`` that takes an INIT queue pair through RTR to RTS towards ``remote``."""
    addr, _, _, _, _, _, qp_mod, _ = mods
    attr = qp_mod.QPAttr(port_num=port)
    attr.path_mtu = min(local.mtu, remote.mtu)
    attr.dest_qp_num = remote.qpn
    attr.rq_psn = remote.psn  # the PSN the remote sends with (ibv_rc_pingpong's convention)
    attr.sq_psn = local.psn
    attr.max_dest_rd_atomic = local.rd_atomic
    attr.max_rd_atomic = max(1, min(rd_atomic_out, remote.rd_atomic))
    attr.min_rnr_timer = FABRIC_RDMA_MIN_RNR_TIMER
    attr.timeout = FABRIC_RDMA_ACK_TIMEOUT
    attr.retry_cnt = FABRIC_RDMA_RETRY_COUNT
    attr.rnr_retry = FABRIC_RDMA_RNR_RETRY
    if ethernet:  # RoCE addresses by GID; InfiniBand (one subnet) by LID
        route = addr.GlobalRoute(dgid=addr.GID(_gid_text(remote.gid)), sgid_index=gid_index, hop_limit=FABRIC_RDMA_HOP_LIMIT)
        attr.ah_attr = addr.AHAttr(port_num=port, is_global=1, gr=route, dlid=remote.lid)
    else:
        attr.ah_attr = addr.AHAttr(port_num=port, dlid=remote.lid)
    return attr


def work_request(mods, wr_id: int, op: Op, region: Region, offset: int, length: int, remote_addr: int, rkey: int):
    """One signalled RDMA READ/WRITE ``SendWR`` between ``region[offset:]`` and remote memory."""
    _, _, _, e, _, _, _, wr = mods
    opcode = e.ibv_wr_opcode.IBV_WR_RDMA_READ if op is Op.READ else e.ibv_wr_opcode.IBV_WR_RDMA_WRITE
    sge = wr.SGE(region.addr + offset, length, region.lkey)
    request = wr.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=e.ibv_send_flags.IBV_SEND_SIGNALED)
    request.set_wr_rdma(rkey, remote_addr)
    return request


def pick_gid(mods, ctx, port: int, table_len: int, *, ethernet: bool) -> tuple[int, bytes]:
    """``(index, GID)`` peers reach this port by.

    InfiniBand: the first non-zero GID (routing is by LID anyway).  RoCE: a
    RoCE v2 GID (routable) with an IPv4-mapped address (the usual fabric)
    first, then any RoCE v2 one, then any; ``VerbsError`` if there is none,
    which on RoCE means the netdev has no IP address.
    """
    e = mods[3]
    best = None
    for index in range(min(table_len, FABRIC_RDMA_GIDS_MAX)):
        try:
            gid = _gid_bytes(ctx.query_gid(port, index))
        except Exception:  # noqa: BLE001, S112 - an empty entry may refuse to be read
            continue
        if not any(gid):
            continue
        if not ethernet:
            return index, gid
        try:
            v2 = ctx.query_gid_type(port, index) == e.ibv_gid_type_sysfs.IBV_GID_TYPE_SYSFS_ROCE_V2
        except Exception:  # noqa: BLE001 - no type: treat as RoCE v1
            v2 = False
        rank = (v2, gid[:12] == bytes(10) + b"\xff\xff")
        if best is None or rank > best[0]:
            best = (rank, index, gid)
    if best is not None:
        return best[1], best[2]
    if not ethernet:
        return 0, bytes(16)  # an IB port without GIDs: reached by LID alone
    raise VerbsError(f"port {port} has no usable GID (is its netdev up, with an IP address?)")


# --- the seam ----------------------------------------------------------------------------


class PyverbsQP(QueuePair):
    def __init__(self, device: PyverbsDevice, *, remote_access: bool, send_depth: int):
        self._device = device
        with _verbs_errors(f"create an RC queue pair on {device.name}"):
            init, attr = init_attrs(device._mods, device._cq, port=device._port, send_depth=send_depth, remote_access=remote_access)
            self._qp = device._mods[6].QP(device._pd, init, attr)  # left in INIT: RC needs the remote QPN for RTR
        self.local = QpAddress(qpn=self._qp.qp_num, psn=secrets.randbits(24), lid=device._lid, gid=device._gid,
                               mtu=device._mtu, rd_atomic=device._rd_atomic_in)

    def connect(self, remote: QpAddress) -> None:
        device = self._device
        with _verbs_errors(f"connect queue pair {self.local.qpn} to {remote.qpn} on {device.name}"):
            self._qp.to_rts(rts_attr(device._mods, port=device._port, ethernet=device._ethernet, gid_index=device._gid_index,
                                     local=self.local, remote=remote, rd_atomic_out=device._rd_atomic_out))

    def post(self, wr_id: int, op: Op, region: Region, offset: int, length: int, remote_addr: int, rkey: int) -> None:
        with _verbs_errors(f"post {op.value} of {length} bytes on queue pair {self.local.qpn}"):
            self._qp.post_send(work_request(self._device._mods, wr_id, op, region, offset, length, remote_addr, rkey))

    def close(self) -> None:
        with _verbs_errors(f"destroy queue pair {self.local.qpn}"):
            self._qp.close()


class PyverbsDevice(Device):
    """One port of an RDMA device: the first active one, or ``NAME:PORT``."""

    def __init__(self, spec: str | None, *, cq_depth: int):
        self._mods = load()
        _, cq, device, e, _, pd, _, _ = self._mods
        names, why = probe()
        name, _, port = (spec or "").partition(":")
        name = name or (names[0] if names else "")
        if not name:
            raise VerbsError(why)
        self._maps: list[tuple[mmap.mmap, object, object]] = []  # (memory, its ctypes export, its MR)
        self._ctx = None
        try:
            with _verbs_errors(f"open RDMA device {name}"):
                self._ctx = device.Context(name=name)
                attr = self._ctx.query_device()
                self._port, port_attr = self._pick_port(int(port) if port else None, attr.phys_port_cnt)
                self._ethernet = port_attr.link_layer == e.IBV_LINK_LAYER_ETHERNET
                self._gid_index, self._gid = pick_gid(self._mods, self._ctx, self._port, port_attr.gid_tbl_len, ethernet=self._ethernet)
                self._lid = port_attr.lid
                self._mtu = int(port_attr.active_mtu)
                self._rd_atomic_in = max(1, min(attr.max_qp_rd_atom, FABRIC_RDMA_READS_MAX))
                self._rd_atomic_out = max(1, min(attr.max_qp_init_rd_atom, FABRIC_RDMA_READS_MAX))
                self._pd = pd.PD(self._ctx)
                self._channel = cq.CompChannel(self._ctx)
                fd = getattr(self._channel, "fd", None)  # pyverbs of rdma-core 44 does not expose it
                if fd is None:
                    self._channel.close()
                    self._channel = None
                else:
                    os.set_blocking(fd, False)  # get_cq_event must never block the trio thread
                self._cq = cq.CQ(self._ctx, cq_depth, None, self._channel, 0)
            self.completion_fd = fd
        except BaseException:
            self.close()
            raise
        link = "RoCE" if self._ethernet else "InfiniBand"
        self.name = f"{name} port {self._port} ({link}, GID index {self._gid_index}, MTU {256 << (self._mtu - 1)})"
        self._closed = False

    def _pick_port(self, wanted: int | None, ports: int):
        assert self._ctx is not None  # opened by __init__ before it picks the port
        active = self._mods[3].ibv_port_state.IBV_PORT_ACTIVE
        for number in [wanted] if wanted else range(1, ports + 1):
            port_attr = self._ctx.query_port(number)
            if port_attr.state == active:
                return number, port_attr
        raise VerbsError(f"port {wanted} is not active" if wanted else "no active port")

    def register(self, nbytes: int, *, remote: bool) -> Region:
        e, mr = self._mods[3], self._mods[4]
        memory = mmap.mmap(-1, nbytes)
        export = (ctypes.c_char * nbytes).from_buffer(memory)
        address = ctypes.addressof(export)
        access = e.ibv_access_flags.IBV_ACCESS_LOCAL_WRITE
        if remote:
            access |= e.ibv_access_flags.IBV_ACCESS_REMOTE_READ | e.ibv_access_flags.IBV_ACCESS_REMOTE_WRITE
        with _verbs_errors(f"register {nbytes >> 20} MiB on {self.name} (is `ulimit -l` big enough?)"):
            region = mr.MR(self._pd, nbytes, access, address=address)
        self._maps.append((memory, export, region))
        return Region(view=memoryview(memory), addr=address, lkey=region.lkey, rkey=region.rkey if remote else 0)

    def open_qp(self, *, remote_access: bool, send_depth: int) -> PyverbsQP:
        return PyverbsQP(self, remote_access=remote_access, send_depth=send_depth)

    def arm(self) -> None:
        with _verbs_errors(f"arm the completion queue of {self.name}"):
            self._cq.req_notify()

    def consume_event(self) -> None:
        try:
            self._channel.get_cq_event(self._cq)
        except Exception:  # noqa: BLE001 - EAGAIN: nothing there (the fd is non-blocking)
            return
        self._cq.ack_events(1)

    def poll(self, max_entries: int) -> list[Completion]:
        e = self._mods[3]
        with _verbs_errors(f"poll the completion queue of {self.name}"):
            _, wcs = self._cq.poll(max_entries)
        done = []
        for wc in wcs:
            error = None
            if wc.status != e.ibv_wc_status.IBV_WC_SUCCESS:
                try:
                    status = e.ibv_wc_status(wc.status).name
                except ValueError:
                    status = f"status {wc.status}"
                error = f"work completion {status} (vendor error 0x{wc.vendor_err:x})"
            done.append(Completion(wc.wr_id, error))
        return done

    def poll_wait(self, timeout_s: float) -> list[Completion]:
        deadline = time.monotonic() + timeout_s
        while not (done := self.poll(FABRIC_RDMA_POLL_BATCH)) and time.monotonic() < deadline:
            time.sleep(FABRIC_RDMA_POLL_SLEEP_S)
        return done

    def close(self) -> None:
        if getattr(self, "_closed", False) or self._ctx is None:
            return
        self._closed = True
        # The context closes what was made from it, children first (QPs, MRs, CQ, channel, PD).
        try:
            self._ctx.close()
        except Exception as e:  # noqa: BLE001 - closing: report, carry on
            log.warning("fabric: closing %s: %s", getattr(self, "name", "the RDMA device"), e)
        # The mmaps stay until the last memoryview of them is gone; they are no longer registered.
        self._maps.clear()
