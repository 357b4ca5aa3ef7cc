"""Bad input, generated: mount options and extended attributes.

Every mount option string either parses into values inside their documented
ranges or fails with ``ConfigError`` naming the option; the real helper turns
that into a one-line message and exit status 1, never a traceback.  Every
xattr call on a live mount either succeeds or fails with the errno a POSIX
caller expects, the mount stays up, and what ``getxattr``/``listxattr``
report afterwards is exactly what was accepted.
"""

import errno
import math
import os
import re
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from mounting import REPO, is_mounted

from aiturbofs._errors import AiturboError, ConfigError
from aiturbofs.node import _options
from aiturbofs.node._options import OPTIONS, build_config, parse_options
from aiturbofs.vfs import _xattr

MOUNT = [sys.executable, os.path.join(REPO, "mount.aiturbo")]
ENV = dict(os.environ, PYTHONPATH=REPO)

# ------------------------------------------------------------ mount options

# Values that look almost right: numbers of every shape, units, addresses, paths.
_NUMBERISH = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "1e999", "0x10", "1_000", "²", "١٢", "9" * 400, "1" * 5000, "0", "00",
                     "64G", "1.5T", "1KiB", "12 M", "7mb", "-1G", ":", "h:", ":1", "h:65536", "h:²", "[::1]:7700",
                     "/", "/abs/path", "rel/path", "off", "staged", "durable", "tcp", "rdma", "auto", "yes", "no", "true"]),
)
_VALUE = st.one_of(st.none(), _NUMBERISH, st.text(max_size=40))


def _check_parsed(out: dict) -> None:
    """What parse_options returns is within each option's documented range."""
    for name, value in out.items():
        kind = OPTIONS[name][0]
        if kind == "flag":
            assert isinstance(value, bool)
        elif kind == "size":
            assert isinstance(value, int) and value >= 0
        elif kind == "float":
            assert isinstance(value, float) and math.isfinite(value) and 0 <= value < 1e9
        elif kind == "int":
            assert isinstance(value, int) and 1 <= value <= 16
        elif kind == "rate":
            assert isinstance(value, float) and 0 < value < 1e6
        elif kind == "addr":
            if value == "off" and name in getattr(_options, "ADDR_OFF_OPTIONS", ()):
                continue
            host, _, port = value.rpartition(":")
            assert host and 0 <= int(port) <= 65535
        elif kind.startswith("choice:"):
            assert value in kind[7:].split("|")
        elif kind == "path":
            assert os.path.isabs(value)
        assert not isinstance(value, str) or "\0" not in value


def _parse_and_build(text: str) -> None:
    out = parse_options(text)
    _check_parsed(out)
    build_config("file:///tmp/backend", "/mnt/x", out, foreground=True)


@settings(max_examples=400, deadline=None, database=None)
@given(st.text(max_size=80))
def test_arbitrary_option_text_parses_or_names_the_problem(text):
    items = [s.strip() for s in text.split(",") if s.strip()]
    try:
        _parse_and_build(text)
    except ConfigError as exc:
        names = {item.partition("=")[0] for item in items}
        assert any((name and name in str(exc)) or repr(name) in str(exc) for name in names), (text, str(exc))


@settings(max_examples=600, deadline=None, database=None)
@given(name=st.sampled_from(sorted(OPTIONS)), value=_VALUE, cluster=st.booleans())
def test_every_known_option_with_any_value(name, value, cluster):
    """Each option alone, and in cluster mode (fabric + secret_file), with any value."""
    if value is not None and "," in value:
        value = value.replace(",", "")
    item = name if value is None else f"{name}={value}"
    text = f"fabric=127.0.0.1:0,secret_file=/etc/aiturbo/secret,{item}" if cluster else item
    try:
        _parse_and_build(text)
    except ConfigError as exc:
        assert name in str(exc), (text, str(exc))
        assert "\n" not in str(exc)


@pytest.mark.parametrize("opts, word", [
    ("dram=", "dram"),
    ("dram=12parsecs", "dram"),
    ("dram=" + "9" * 400, "dram"),
    ("replicas=²", "replicas"),
    ("fabric=nohost", "fabric"),
    ("drain_timeout=nan", "drain_timeout"),
    ("spill=relative/dir", "spill"),
    ("sync_close=maybe", "sync_close"),
    ("secret_file=/etc/aiturbo/secret", "secret_file"),  # cluster-only option without fabric=
    ("fsync=staged,bogus_opt=1", "bogus_opt"),
])
def test_helper_rejects_bad_options_in_one_line(tmp_path, opts, word):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run([*MOUNT, f"file://{tmp_path}", str(mnt), "-o", f"state_dir={tmp_path}/s,{opts}"],
                       capture_output=True, text=True, env=ENV, timeout=60)
    try:
        assert r.returncode == 1, (r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mount.aiturbo: ") and word in lines[0], r.stderr
        assert "Traceback" not in r.stderr
        assert not is_mounted(str(mnt))
        assert not (tmp_path / "s").exists(), "a refused mount must not create its state dir"
    finally:
        if is_mounted(str(mnt)):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)


def test_helper_usage_error_has_no_traceback(tmp_path):
    r = subprocess.run([*MOUNT, f"file://{tmp_path}", str(tmp_path), "--no-such-flag"], capture_output=True, text=True,
                       env=ENV, timeout=60)
    assert r.returncode == 2 and "--no-such-flag" in r.stderr and "Traceback" not in r.stderr, r.stderr


# ------------------------------------------------------------------ xattrs

XATTR_NAME_MAX = 255  # the kernel's limits (ERANGE / E2BIG before the request reaches us)
XATTR_SIZE_MAX = 65536
STATES = {b"staged", b"persisting", b"durable"}
GROUP, GROUP_SIZE, FSYNC, STATE = (b"user.aiturbo.group", b"user.aiturbo.group.size", b"user.aiturbo.fsync",
                                   b"user.aiturbo.state")

_SUFFIX = st.one_of(
    st.binary(min_size=0, max_size=12).filter(lambda b: b"\0" not in b),
    st.text(alphabet="abcz.-_:/ é", max_size=12).map(lambda s: s.encode()),
    st.integers(240, 300).map(lambda n: b"n" * n),  # around the name limit
)
_NAME = st.one_of(
    st.sampled_from([GROUP, GROUP_SIZE, FSYNC, STATE, b"user.aiturbo.", b"user.aiturbo.groups", b"user.",
                     b"user.color", b"security.selinux", b"security.capability", b"trusted.x", b"trusted.overlay.opaque"]),
    st.tuples(st.sampled_from([b"user.aiturbo.", b"user.", b"security.", b"trusted."]), _SUFFIX).map(b"".join),
)
_XVALUE = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"staged", b"durable", b"Durable", b"job-1", b"a b", b"x" * 128, b"x" * 129, b"0", b"1",
                     b"000001", b"65536", b"65537", b"-1", b"+5", b" 8", b"8\0", b"\xff\xfe", "８".encode(),
                     b"9" * 5000, b"1" * 7]),
    st.integers(-(2**64), 2**64).map(lambda n: str(n).encode()),
    st.sampled_from([60 * 1024, XATTR_SIZE_MAX - 1, XATTR_SIZE_MAX, XATTR_SIZE_MAX + 1, 200_000]).map(lambda n: b"v" * n),
)
_OP = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(["f", "d"]), _NAME, _XVALUE,
              st.sampled_from([0, 0, 0, os.XATTR_CREATE, os.XATTR_REPLACE])),
    st.tuples(st.just("get"), st.sampled_from(["f", "d"]), _NAME),
    st.tuples(st.just("remove"), st.sampled_from(["f", "d"]), _NAME),
    st.tuples(st.just("list"), st.sampled_from(["f", "d"])),
)


def _value_error(name: bytes, value: bytes) -> int | None:
    """The errno setxattr must give for ``name=value`` regardless of what exists (None: accepted)."""
    if len(name) > XATTR_NAME_MAX:
        return errno.ERANGE
    if len(value) > XATTR_SIZE_MAX:
        return errno.E2BIG
    if not name.startswith(b"user."):
        return errno.EOPNOTSUPP
    if name == STATE:
        return errno.EPERM
    if name == GROUP:
        return None if re.fullmatch(rb"[A-Za-z0-9._:-]{1,128}", value) else errno.EINVAL
    if name == GROUP_SIZE:
        return None if re.fullmatch(rb"[0-9]{1,6}", value) and 1 <= int(value) <= 65536 else errno.EINVAL
    if name == FSYNC:
        return None if value in (b"staged", b"durable") else errno.EINVAL
    if name.startswith(b"user.aiturbo."):
        return errno.EINVAL
    return None


@settings(max_examples=500, deadline=None, database=None)
@given(name=_NAME, value=_XVALUE)
@example(name=GROUP_SIZE, value=b"9" * 5000)  # int() refuses over 4300 digits: was an internal error (EIO)
def test_xattr_validation_raises_only_the_vocabulary(name, value):
    """The validator alone, fast: an accepted value or one of our errors, never another exception."""
    try:
        _xattr.validate_set(name, value)
    except AiturboError as exc:
        got = exc.errno
    else:
        got = None
    want = _value_error(name, value)
    if want in (errno.ERANGE, errno.E2BIG):
        return  # the kernel refuses these before the daemon sees them
    assert got == want, (name, value[:40], got, want)


def _errno_of(fn, *args) -> int | None:
    try:
        fn(*args)
    except OSError as exc:
        return exc.errno
    return None


class _XattrChecker:
    """Applies one example's calls to a fresh file and directory and checks every answer."""

    def __init__(self, root: str):
        self.root = root
        self.count = 0

    def run(self, ops) -> None:
        self.count += 1
        paths = {"f": os.path.join(self.root, f"f{self.count}"), "d": os.path.join(self.root, f"d{self.count}")}
        with open(paths["f"], "wb") as f:
            f.write(b"x")
        os.mkdir(paths["d"])
        model: dict[str, dict[bytes, bytes]] = {"f": {}, "d": {}}
        for op in ops:
            kind, target, path = op[0], op[1], paths[op[1]]
            have = model[target]
            if kind == "set":
                self._set(path, have, *op[2:])
            elif kind == "get":
                self._get(path, target, have, op[2])
            elif kind == "remove":
                self._remove(path, have, op[2])
            else:
                listed = {os.fsencode(n) for n in os.listxattr(path)}
                assert {n for n in listed if n.startswith(b"user.")} == set(have), (path, listed, set(have))
            os.stat(self.root)  # the mount is still alive
        for target, have in model.items():  # afterwards, everything accepted reads back
            for name, value in have.items():
                assert os.getxattr(paths[target], name) == value, (target, name)

    @staticmethod
    def _set(path: str, have: dict, name: bytes, value: bytes, flags: int) -> None:
        got = _errno_of(os.setxattr, path, name, value, flags)
        want = _value_error(name, value)
        if want in (errno.ERANGE, errno.E2BIG):
            assert got == want, (name, len(value), got)
            return
        exists = name in have or (name == STATE and os.path.isfile(path))
        flag_err = errno.EEXIST if flags == os.XATTR_CREATE and exists else \
            errno.ENODATA if flags == os.XATTR_REPLACE and not exists else None
        if len(value) > 60 * 1024 and got in (errno.E2BIG, errno.ERANGE, errno.ENOSPC):
            return  # near the kernel's request size: a refusal is fine, a wrong read-back is not
        allowed = {want, flag_err} - {None} or {None}
        if name == STATE and flags == os.XATTR_CREATE and os.path.isdir(path):
            # A directory has a state once its backend form (or a symlink in
            # it) is persisted, which the persister does meanwhile: EEXIST is
            # right then (for XATTR_REPLACE, ENODATA and EPERM both are already).
            allowed.add(errno.EEXIST)
        if want == errno.EOPNOTSUPP:
            allowed |= {errno.EPERM}  # an LSM may refuse security.* first
        if name == b"security.capability":
            allowed |= {errno.EINVAL}  # the kernel parses file capabilities before asking the filesystem
        assert got in allowed, (name, value[:40], flags, errno.errorcode.get(got, got), allowed)
        if got is None:
            have[name] = value

    @staticmethod
    def _get(path: str, target: str, have: dict, name: bytes) -> None:
        try:
            value, got = os.getxattr(path, name), None
        except OSError as exc:
            value, got = None, exc.errno
        if len(name) > XATTR_NAME_MAX:
            assert got == errno.ERANGE
        elif name == STATE:
            # the backend keeps directories too: they have a state (docs/design.md)
            assert value in STATES, (target, value, got)
        elif not name.startswith(b"user."):
            assert got in (errno.ENODATA, errno.EOPNOTSUPP), (name, got)
        elif name in have:
            assert value == have[name], (name, value[:40] if value else got)
        else:
            assert got == errno.ENODATA, (name, got)

    @staticmethod
    def _remove(path: str, have: dict, name: bytes) -> None:
        got = _errno_of(os.removexattr, path, name)
        if len(name) > XATTR_NAME_MAX:
            assert got == errno.ERANGE
        elif name == STATE:
            assert got == errno.EPERM
        elif not name.startswith(b"user."):
            assert got in (errno.ENODATA, errno.EOPNOTSUPP, errno.EPERM), (name, got)
        elif name in have:
            assert got is None, (name, got)
            del have[name]
        else:
            assert got == errno.ENODATA, (name, got)


def test_xattr_calls_with_random_names_and_values(mnt):
    """One mount, many examples: each gets a fresh file and directory."""
    checker = _XattrChecker(mnt.mountpoint)

    @settings(max_examples=int(os.environ.get("FUZZ_N", "150")), deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(_OP, min_size=1, max_size=10))
    def check(ops):
        checker.run(ops)

    started = time.monotonic()
    check()
    print(f"{checker.count} examples in {time.monotonic() - started:.1f} s")
    assert is_mounted(mnt.mountpoint) and os.listdir(mnt.mountpoint)
    log = mnt.log()
    assert "BUG" not in log and "Traceback" not in log, log[-5000:]
