"""A private PostgreSQL 15 instance on loopback, for tests.

``PgServer`` runs ``initdb`` and ``pg_ctl`` from ``/usr/lib/postgresql/15/bin``
(Debian's ``postgresql`` package) on a data directory of its own under /tmp,
listening on a free 127.0.0.1 port with its Unix socket in that directory, so
it never meets the host's own cluster.  PostgreSQL refuses to run as root:
when the tests run as root, every server command runs as the ``postgres``
user through ``runuser`` and the directory is handed to that user.

The superuser is ``aiturbo`` with trust authentication (no password).
``url`` names the database made at start; ``new_database()`` makes a fresh
one and returns its URL (one per test keeps tests apart).  ``stop()`` kills
the server with ``pg_ctl stop -m immediate`` and removes the directory; the
context manager and the session-scoped pytest fixture ``pg_server``
(tests/plugin.py) always do so, also after a failure.  The fixture skips the
tests when PostgreSQL is not installed.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import subprocess
import tempfile

from loopback import HOST, free_port

PG_BIN = "/usr/lib/postgresql/15/bin"
SUPERUSER = "aiturbo"
OS_USER = "postgres"  # runs the server when the tests run as root
START_TIMEOUT_S = 60  # pg_ctl start -w waits this long for the server to accept connections
COMMAND_TIMEOUT_S = 120.0  # initdb, pg_ctl: a hung command fails the test instead of hanging it
START_ATTEMPTS = 3  # a free port can be taken between choosing it and the server binding it
SKIP_REASON = "PostgreSQL 15 not installed (apt-get install postgresql)"


def installed() -> bool:
    return all(os.access(os.path.join(PG_BIN, tool), os.X_OK) for tool in ("initdb", "pg_ctl"))


class PgServer:
    """One PostgreSQL cluster in a temporary directory; see the module doc."""

    def __init__(self) -> None:
        self.dir: str | None = None
        self.port: int | None = None
        self.url: str | None = None
        self._counter = itertools.count(1)
        self._started = False

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> PgServer:
        """initdb, start the server and make the first database; ``self``."""
        if not installed():
            raise RuntimeError(SKIP_REASON)
        try:
            self.dir = tempfile.mkdtemp(prefix="aiturbo-pg-", dir="/tmp")
            if os.geteuid() == 0:
                entry = pwd.getpwnam(OS_USER)
                os.chown(self.dir, entry.pw_uid, entry.pw_gid)
            self._run("initdb", "-D", self.dir, "-A", "trust", "-U", SUPERUSER, "-E", "UTF8", "--no-sync")
            self._start_on_free_port()
            self.url = self.new_database()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_on_free_port(self) -> None:
        for attempt in range(START_ATTEMPTS):
            self.port = free_port()
            try:
                self._pg_ctl_start()
                return
            except RuntimeError:
                if attempt == START_ATTEMPTS - 1:
                    raise

    def _pg_ctl_start(self) -> None:
        assert self.dir is not None and self.port is not None
        # fsync=off: a throwaway test cluster need not survive a power cut,
        # and CREATE DATABASE per test stays cheap.
        options = f"-c listen_addresses={HOST} -p {self.port} -k {self.dir} -c fsync=off"
        log = os.path.join(self.dir, "log")
        wait = ("-t", str(START_TIMEOUT_S), "-w")
        self._run("pg_ctl", "-D", self.dir, "-o", options, "-l", log, *wait, "start")
        self._started = True

    def kill(self) -> None:
        """Stop the server as a crash would (its data stays); ``start_again`` brings it back."""
        assert self.dir is not None and self._started
        self._started = False
        self._run("pg_ctl", "-D", self.dir, "-m", "immediate", "-w", "stop")

    def start_again(self) -> None:
        """Start a killed server on the same port, with its data."""
        self._pg_ctl_start()

    def stop(self) -> None:
        """Kill the server (no shutdown checkpoint) and remove its directory.

        Idempotent; never raises for a server that did not start.
        """
        directory, self.dir = self.dir, None
        if directory is None:
            return
        try:
            if self._started:
                self._started = False
                self._run("pg_ctl", "-D", directory, "-m", "immediate", "-w", "stop", check=False)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def __enter__(self) -> PgServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- databases -------------------------------------------------------------------

    def url_of(self, dbname: str) -> str:
        return f"postgresql://{SUPERUSER}@{HOST}:{self.port}/{dbname}"

    def new_database(self) -> str:
        """Create an empty database; its URL."""
        name = f"db{next(self._counter)}"
        with self.connect("postgres") as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url_of(name)

    def connect(self, dbname: str | None = None):
        """A psycopg connection (autocommit) to ``dbname`` (default: ``url``'s)."""
        import psycopg

        url = self.url if dbname is None else self.url_of(dbname)
        return psycopg.connect(url, autocommit=True)

    # --- helpers ---------------------------------------------------------------------

    def _run(self, tool: str, *args: str, check: bool = True) -> None:
        command = [os.path.join(PG_BIN, tool), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", OS_USER, "--", *command]
        proc = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            cwd="/tmp",  # the postgres user may not be able to enter ours
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"{tool} failed ({proc.returncode}): {proc.stderr.strip()}{self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.dir, "log"), "rb") as f:
                return "\nserver log:\n" + f.read()[-2000:].decode(errors="replace")
        except (OSError, TypeError):
            return ""

