"""The kernel protocol layouts of aiturbofs.fuse._abi against the kernel's header and the kernel.

A C probe compiled against the installed <linux/fuse.h> prints the size of
every structure and the offset of every field it has; each must equal the
layout's.  Fields newer than the installed header (Debian 12 ships 7.38:
no ``backing_id``, no ``max_stack_depth``) cannot be checked here; the
running kernel checks those when it accepts an INIT reply and a
passthrough open.
"""

import json
import os
import shutil
import subprocess
import tempfile

import pytest
from mounting import aiturbo

from aiturbofs.fuse import _abi, probe_passthrough

HEADER = "/usr/include/linux/fuse.h"
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None or not os.path.exists(HEADER),
                               reason=f"gcc or {HEADER} missing (scripts/setup.sh --test installs gcc, linux-libc-dev)")

# all a 7.38 header (Debian 12) may lack: 7.40 passthrough, 7.43 request timeouts
UNKNOWN_TO_738 = ["struct fuse_backing_map", "struct fuse_init_out.max_stack_depth",
                  "struct fuse_init_out.request_timeout", "struct fuse_open_out.backing_id"]

# layouts that are the head of a larger C structure: (C struct, the fields the layout covers)
HEADS = {"entry_out_head": "entry_out", "attr_out_head": "attr_out", "dirent_head": "dirent",
         "setxattr_in_compat": "setxattr_in"}


def _c_name(layout: _abi.Layout) -> str:
    return "struct fuse_" + HEADS.get(layout.name, layout.name)


def _compiles(tmp_path, expr: str) -> bool:
    src = tmp_path / "probe.c"
    src.write_text(f"#include <stddef.h>\n#include <stdio.h>\n#include <sys/ioctl.h>\n#include <linux/fuse.h>\nint main(void) {{ return (int)({expr}); }}\n")
    return subprocess.run(["gcc", "-fsyntax-only", str(src)], capture_output=True).returncode == 0


def _probe(tmp_path, exprs: list[str]) -> list[int]:
    src = tmp_path / "probe.c"
    body = "".join(f'    printf("%zu\\n", (size_t)({e}));\n' for e in exprs)
    src.write_text(f"#include <stddef.h>\n#include <stdio.h>\n#include <sys/ioctl.h>\n#include <linux/fuse.h>\nint main(void) {{\n{body}    return 0;\n}}\n")
    exe = tmp_path / "probe"
    subprocess.run(["gcc", "-o", str(exe), str(src)], check=True, capture_output=True)
    return [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]


@needs_gcc
def test_every_layout_matches_the_installed_kernel_header(tmp_path):
    checks: list[tuple[str, str, int]] = []  # (what, C expression, our value)
    unknown = []
    for layout in _abi.LAYOUTS:
        c = _c_name(layout)
        if not _compiles(tmp_path, f"sizeof({c})"):
            unknown.append(c)
            continue
        if layout.name not in HEADS:
            checks.append((f"sizeof({c})", f"sizeof({c})", layout.size))
        for field, offset in layout.offsets.items():
            if field in layout.reserved:
                continue  # reserved space: newer fields are carved out of it (init_out.unused moved in 7.40)
            expr = f"offsetof({c}, {field})"
            if _compiles(tmp_path, expr):
                checks.append((expr, expr, offset))
            else:
                unknown.append(f"{c}.{field}")
    checks += [
        ("sizeof(struct fuse_entry_out)", "sizeof(struct fuse_entry_out)", _abi.ENTRY_OUT_SIZE),
        ("offsetof(struct fuse_entry_out, attr)", "offsetof(struct fuse_entry_out, attr)", _abi.ENTRY_OUT_HEAD.size),
        ("sizeof(struct fuse_attr_out)", "sizeof(struct fuse_attr_out)", _abi.ATTR_OUT_SIZE),
        ("offsetof(struct fuse_attr_out, attr)", "offsetof(struct fuse_attr_out, attr)", _abi.ATTR_OUT_HEAD.size),
        ("sizeof(struct fuse_statfs_out)", "sizeof(struct fuse_statfs_out)", _abi.STATFS_OUT_SIZE),
        ("FUSE_NAME_OFFSET", "FUSE_NAME_OFFSET", _abi.DIRENT_HEAD.size),
        ("FUSE_COMPAT_SETXATTR_IN_SIZE", "FUSE_COMPAT_SETXATTR_IN_SIZE", _abi.COMPAT_SETXATTR_IN_SIZE),
    ]
    for name in ("LOOKUP FORGET GETATTR SETATTR READLINK SYMLINK MKNOD MKDIR UNLINK RMDIR RENAME LINK OPEN READ "
                 "WRITE STATFS RELEASE FSYNC SETXATTR GETXATTR LISTXATTR REMOVEXATTR FLUSH INIT OPENDIR READDIR "
                 "RELEASEDIR FSYNCDIR ACCESS CREATE INTERRUPT DESTROY BATCH_FORGET FALLOCATE READDIRPLUS RENAME2 "
                 "LSEEK SYNCFS TMPFILE NOTIFY_INVAL_INODE NOTIFY_INVAL_ENTRY NOTIFY_DELETE").split():
        checks.append((f"FUSE_{name}", f"FUSE_{name}", getattr(_abi, name)))
    for name in ("ASYNC_READ", "ATOMIC_O_TRUNC", "BIG_WRITES", "DO_READDIRPLUS", "WRITEBACK_CACHE", "MAX_PAGES",
                 "SETXATTR_EXT", "INIT_EXT", "HAS_EXPIRE_ONLY", "EXPLICIT_INVAL_DATA", "PARALLEL_DIROPS"):
        checks.append((f"FUSE_{name}", f"FUSE_{name}", getattr(_abi, name)))
    for name in ("DIRECT_IO", "KEEP_CACHE", "NOFLUSH", "PARALLEL_DIRECT_WRITES"):
        checks.append((f"FOPEN_{name}", f"FOPEN_{name}", getattr(_abi, f"FOPEN_{name}")))
    checks.append(("FUSE_DEV_IOC_CLONE", "FUSE_DEV_IOC_CLONE", _abi.DEV_IOC_CLONE))
    got = _probe(tmp_path, [expr for _, expr, _ in checks])
    wrong = [f"{what}: header {g}, ours {want}" for (what, _, want), g in zip(checks, got, strict=True) if g != want]
    assert not wrong, "\n".join(wrong)
    # Not vacuous: the installed header knows nearly everything we declare.
    assert len(checks) > 200, len(checks)
    assert set(unknown) <= set(UNKNOWN_TO_738), unknown  # a newer header knows more, never less


def test_newer_fields_sit_where_the_kernel_documents_them():
    """What the 7.38 header cannot check: the 7.40 passthrough fields take the place of its padding."""
    assert _abi.OPEN_OUT.offsets == {"fh": 0, "open_flags": 8, "backing_id": 12} and _abi.OPEN_OUT.size == 16
    assert _abi.INIT_OUT.offsets["flags2"] == 32 and _abi.INIT_OUT.offsets["max_stack_depth"] == 36
    assert _abi.INIT_OUT.size == 64 and _abi.BACKING_MAP.size == 16
    assert (_abi.DEV_IOC_BACKING_OPEN, _abi.DEV_IOC_BACKING_CLOSE) == (0x4010E501, 0x4004E502)


def test_layouts_pack_and_unpack_by_name():
    raw = _abi.OPEN_OUT.pack(fh=7, open_flags=_abi.FOPEN_PASSTHROUGH, backing_id=3)
    assert len(raw) == 16 and _abi.OPEN_OUT.unpack(raw) == (7, _abi.FOPEN_PASSTHROUGH, 3)
    init = _abi.INIT_IN.unpack(_abi.INIT_IN.pack(major=7, minor=45, flags=_abi.INIT_EXT, flags2=_abi.PASSTHROUGH >> 32))
    assert (init.major, init.minor, init.flags2 << 32) == (7, 45, _abi.PASSTHROUGH)
    with pytest.raises(TypeError, match="no field"):
        _abi.OPEN_OUT.pack(fh=1, backing=2)
    assert _abi.dirent_size(1) == 32 and _abi.dirent_size(8) == 32 and _abi.dirent_size(9) == 40
    assert _abi.dirent_size(1, plus=True) == 128 + 24 + 8


# ---------------------------------------------------------------- the live kernel
def _kernel_at_least(major: int, minor: int) -> bool:
    release = os.uname().release.split("-")[0].split(".")
    return (int(release[0]), int(release[1])) >= (major, minor)


@pytest.mark.fuse
@pytest.mark.root("mount(2) of /dev/fuse")
def test_the_kernel_takes_our_init_reply_and_a_backing_file():
    """The 7.40 fields the header above cannot check: the kernel enables passthrough only if INIT's
    reply carries it with max_stack_depth in its place, and then takes a backing_map."""
    got = probe_passthrough()
    if _kernel_at_least(6, 9):
        assert got.available, got
        assert got.reason.startswith("negotiated with FUSE 7.") and int(got.protocol.split(".")[1]) >= 40, got
    else:
        assert not got.available and "7.40" in got.reason, got
    with open("/proc/self/mountinfo") as f:
        assert "aiturbofs-probe" not in f.read()  # unmounted again
    assert not [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("aiturbofs-probe-")]


@pytest.mark.parametrize("asked", ["auto", "passthrough", "kernel", "pyfuse3"])
def test_status_says_which_data_path_serves_and_whether_passthrough_is_there(make_mount, asked):
    available = probe_passthrough().available
    if asked == "passthrough" and not available:
        pytest.skip("this host cannot do FUSE passthrough")
    mnt = make_mount(datapath=asked)
    want = {"auto": "passthrough" if available else "pyfuse3"}.get(asked, asked)
    st = json.loads(aiturbo("status", mnt.mountpoint, "--json").stdout)
    f = st["fuse"]
    assert f["datapath"] == want
    assert f["passthrough_available"] == available and f["passthrough"], f
    human = aiturbo("status", mnt.mountpoint).stdout
    assert f"{want} data path; kernel passthrough " in human, human
    assert f"fuse_datapath={want} passthrough=" in mnt.log()
    with open(mnt.path("f"), "wb") as fh:  # and it serves
        fh.write(b"x" * 100)
    with open(mnt.path("f"), "rb") as fh:
        assert fh.read() == b"x" * 100
