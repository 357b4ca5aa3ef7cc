"""``mount.aiturbo [--config FILE] BACKEND MOUNTPOINT [-o opt,...] [-f]`` — the mount(8) helper.

Without ``-f`` the daemon forks *before* anything starts (no threads, no
trio), and the parent waits until the child reports that the kernel mount is
up, so ``mount -a`` and fstab behave as with any other filesystem: exit 0
means mounted, exit 32 means the mount failed and the message says why.
Settings may come from a TOML file (``--config FILE`` or ``-o config=FILE``,
see ``_config.py``); what the command line says wins over the file.
"""

import argparse
import logging
import os
import sys

from .._errors import AiturboError, ConfigError
from .._limits import CONFIG_PATH_DEFAULT, MOUNT_READY_TIMEOUT_S
from .._version import VersionAction
from ._journal import LOG_FORMAT, log_to_stderr

DESCRIPTION = f"""\
Mount an aiturbofs filesystem: writes land in host DRAM and close() returns at
once; data persists to BACKEND in the background.

BACKEND is an fsspec URL: file:///var/lib/aiturbo/data (default kind) or
s3://bucket/prefix (endpoint via -o s3_endpoint=..., credentials from the
usual AWS_* environment variables).  Files keep their natural layout in the
backend (mount path = object key) and existing objects show up in the mount.

fstab:  file:///var/lib/aiturbo/data  /mnt/aiturbo  aiturbo  defaults  0 0

A TOML config file can hold the backend, the mount point and every option
below (a [mount] table with the same names; `aiturbo config check FILE`
validates one).  It is read only when named: --config FILE, or -o config=FILE
(how an fstab line names it); the command line overrides it.  The systemd
units and the fstab line in the README use {CONFIG_PATH_DEFAULT}:

  s3://bucket/ckpt  /mnt/aiturbo  aiturbo  _netdev,config={CONFIG_PATH_DEFAULT}  0 0
"""


def _parser() -> argparse.ArgumentParser:
    from ..node import options_help

    p = argparse.ArgumentParser(
        prog="mount.aiturbo", description=DESCRIPTION, epilog=options_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("backend", nargs="?",
                   help="backend URL, e.g. file:///var/lib/aiturbo/data or s3://bucket/prefix (default: the config file's)")
    p.add_argument("mountpoint", nargs="?", help="directory to mount on, e.g. /mnt/aiturbo (default: the config file's)")
    p.add_argument("--config", metavar="FILE",
                   help="read the backend, mount point and options from this TOML file (same as -o config=FILE); "
                        "no file is read unless named")
    p.add_argument("-o", dest="options", action="append", default=[], metavar="OPTS", help="comma-separated mount options (below)")
    p.add_argument("-V", "--version", action=VersionAction)
    p.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground, log to stderr")
    # mount(8) passes these; accepted for compatibility
    p.add_argument("-s", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-n", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-v", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-t", dest="fstype", help=argparse.SUPPRESS)
    return p


def _setup_logging(cfg, state_dir: str) -> None:
    level = logging.DEBUG if cfg.debug else logging.INFO
    if cfg.foreground:
        log_to_stderr(level)  # in the journal's format under systemd
    else:
        path = cfg.log or os.path.join(state_dir, "aiturbo.log")
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        logging.basicConfig(level=level, format=LOG_FORMAT, filename=path)
    for noisy in ("botocore", "s3fs", "aiobotocore", "fsspec", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _wait_for_child(read_fd: int) -> int:
    import select

    ready, _, _ = select.select([read_fd], [], [], MOUNT_READY_TIMEOUT_S)
    if not ready:
        print(f"mount.aiturbo: the daemon did not report within {MOUNT_READY_TIMEOUT_S:.0f} s", file=sys.stderr)
        return 32
    message = b""
    while True:
        more = os.read(read_fd, 4096)
        if not more:
            break
        message += more
    text = message.decode(errors="replace")
    if text == "OK":
        return 0
    print(f"mount.aiturbo: {text[4:] if text.startswith('ERR ') else text or 'the daemon exited before mounting'}", file=sys.stderr)
    return 32


def _daemonize() -> int | None:
    """Fork; in the parent return the exit code to use, in the child the pipe fd."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_fd)
        code = _wait_for_child(read_fd)
        os._exit(code)
    os.close(read_fd)
    # The parent's exit says the mount is up; a service manager's socket is not the daemon's to use.
    os.environ.pop("NOTIFY_SOCKET", None)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    os.chdir("/")
    return write_fd


def main(argv: list[str] | None = None) -> int:
    from ..node import build_config, default_state_dir, parse_options, run_node
    from ._config import load_config, mount_settings, split_config_option

    args = _parser().parse_args(argv)
    try:
        config_path, option_text = split_config_option(args.options)
        if args.config and config_path and os.path.abspath(args.config) != os.path.abspath(config_path):
            raise ConfigError(f"--config {args.config} and -o config={config_path} name different files")
        config_path = args.config or config_path
        cf = None
        if config_path:
            # the file's [controller] table is checked too: one file, one verdict
            from .main import controller_actions

            cf = load_config(config_path, controller_actions())
        backend, mountpoint, options = mount_settings(cf, args.backend, args.mountpoint, parse_options(option_text))
        cfg = build_config(backend, mountpoint, options, foreground=args.foreground)
    except AiturboError as exc:
        for line in str(exc).splitlines():  # a config file's problems come one per line
            print(f"mount.aiturbo: {line}", file=sys.stderr)
        return 1
    state_dir = cfg.state_dir or default_state_dir(cfg.mountpoint)
    ready_fd = None
    if not cfg.foreground:
        ready_fd = _daemonize()
    _setup_logging(cfg, state_dir)
    return run_node(cfg, ready_fd)


if __name__ == "__main__":
    sys.exit(main())
