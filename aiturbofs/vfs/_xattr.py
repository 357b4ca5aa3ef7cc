"""The ``user.aiturbo.*`` extended attributes: names, validation, meaning.

* ``user.aiturbo.group`` — the group (job) id that opts a directory's files
  into grouped I/O; 1-128 characters of ``[A-Za-z0-9._:-]``.
* ``user.aiturbo.group.size`` — writers/readers per round, 1..65536.
* ``user.aiturbo.fsync`` — ``staged`` or ``durable``: what fsync waits for.
* ``user.aiturbo.state`` — read-only, computed: staged|persisting|durable|broken.

Tags are inherited by children at creation (the metadata engine copies the
parent's ``user.aiturbo.`` attributes except ``state``).  Other ``user.*``
names are stored as given; other namespaces are not supported (EOPNOTSUPP),
which ``cp -a`` and ``rsync -X`` treat as "no ACLs here".
"""

import re

from .._errors import InvalidArgument, NotPermitted, NotSupported

PREFIX = b"user.aiturbo."
GROUP = b"user.aiturbo.group"
GROUP_SIZE = b"user.aiturbo.group.size"
FSYNC = b"user.aiturbo.fsync"
STATE = b"user.aiturbo.state"

GROUP_SIZE_MAX = 65536
_GROUP_RE = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
FSYNC_MODES = ("staged", "durable")


def validate_set(name: bytes, value: bytes) -> None:
    """Raise the right error if ``name=value`` may not be stored."""
    if not name.startswith(b"user."):
        raise NotSupported(f"xattr namespace of {name!r} is not supported (only user.*)")
    if not name.startswith(PREFIX):
        return
    if name == STATE:
        raise NotPermitted("user.aiturbo.state is read-only")
    if name == GROUP:
        if not _GROUP_RE.fullmatch(value):
            raise InvalidArgument(f"user.aiturbo.group must be 1-128 of [A-Za-z0-9._:-], got {value[:64]!r}")
    elif name == GROUP_SIZE:
        # length first: int() of a digit string past 4300 digits raises ValueError
        if not (len(value) <= 6 and value.isdigit() and 1 <= int(value) <= GROUP_SIZE_MAX):
            raise InvalidArgument(f"user.aiturbo.group.size must be an integer 1..{GROUP_SIZE_MAX}, got {value[:64]!r}")
    elif name == FSYNC:
        if value.decode("ascii", "replace") not in FSYNC_MODES:
            raise InvalidArgument(f"user.aiturbo.fsync must be one of {FSYNC_MODES}, got {value[:64]!r}")
    else:
        raise InvalidArgument(f"unknown aiturbo attribute {name!r} (known: group, group.size, fsync, state)")


def validate_name(name: bytes) -> None:
    """Raise NotSupported for names outside ``user.*``."""
    if not name.startswith(b"user."):
        raise NotSupported(f"xattr namespace of {name!r} is not supported (only user.*)")
