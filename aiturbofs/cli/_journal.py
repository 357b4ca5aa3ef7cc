"""Logging to stderr, in the journal's own format when systemd runs the process.

systemd sets ``JOURNAL_STREAM=DEV:INODE`` when it connects stdout/stderr to
the journal.  It is inherited by children whose stderr may go elsewhere, so
it counts only when it names the stderr this process actually has (what
sd_journal_stream_fd(3) advises).  Then lines carry no timestamp (the journal
stamps them) and start with a ``<N>`` syslog priority, so ``journalctl -p
warning`` finds the warnings.
"""

import logging
import os
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JOURNAL_FORMAT = "%(levelname)s %(name)s: %(message)s"
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def stderr_is_journal() -> bool:
    dev, sep, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    if not sep or not dev.isdigit() or not ino.isdigit():
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


class JournalFormatter(logging.Formatter):
    """``<6>INFO aiturbofs.node: ...``: the priority prefix journald turns into the entry's level."""

    def __init__(self):
        super().__init__(JOURNAL_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        prio = _PRIORITY.get(record.levelno, 6 if record.levelno < logging.WARNING else 3)
        # every line of a traceback gets the prefix, or journald files them as INFO
        return "\n".join(f"<{prio}>{line}" for line in super().format(record).split("\n"))


def log_to_stderr(level: int) -> None:
    """Configure the root logger to write to stderr: journal format under systemd, else timestamped."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter() if stderr_is_journal() else logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
