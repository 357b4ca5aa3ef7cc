"""The config file: one TOML file for everything the command lines can say.

Shape (``systemd/aiturbo.toml.example`` is a commented sample)::

    backend = "s3://bucket/ckpt"      # mount.aiturbo BACKEND
    mountpoint = "/mnt/aiturbo"       # mount.aiturbo MOUNTPOINT
    [mount]                           # the -o options, by the same names
    dram = "64G"
    sync_close = true
    [controller]                      # the flags of `aiturbo controller`, - spelled _
    listen = "10.0.0.1:7700"

The ``[mount]`` keys are the OPTIONS table of ``node/_options.py`` and the
``[controller]`` keys are the controller's own argparse flags, so an option or
flag added there is accepted here without an edit.  Every value goes through
the converter its command-line twin goes through: a value means the same in
the file and on the command line; the file only adds TOML types on top (a flag
is a boolean, seconds and rates are numbers, a size is "64G" or a number of
bytes).  Every problem is collected and reported at once, each naming the
file, the table and the key.  The command line always wins over the file; this
module never reads a file nobody named.
"""

import argparse
import os
import re
import tomllib
from dataclasses import dataclass, field

from .._errors import AiturboError, ConfigError
from .._limits import CONFIG_FILE_BYTES_MAX, GiB, KiB, MiB
from ..node import build_config
from ..node._options import OPTIONS, _convert

TOP_KEYS = {"backend": "str", "mountpoint": "path"}
TABLES = ("mount", "controller")
# [controller] keys whose value the file checks as strictly as a mount option of the same kind;
# a relative secret_file would depend on the working directory, which is / under systemd.
CONTROLLER_KINDS = {"listen": "addr", "secret_file": "path", "backend_gbps": "rate"}
# what a TOML value of each option kind must be, for the type error
_WANT = {
    "flag": "true or false",
    "size": 'a size like "64G" or a number of bytes',
    "float": "a number of seconds",
    "rate": "a number (Gbit/s)",
    "int": "a whole number",
}


@dataclass
class ConfigFile:
    """One config file, read and checked; ``problems`` lists everything wrong with it."""

    path: str
    backend: str | None = None
    mountpoint: str | None = None
    tables: set = field(default_factory=set)  # the tables the file has
    mount: dict = field(default_factory=dict)  # option -> converted value, as parse_options gives
    controller: dict = field(default_factory=dict)  # argparse dest -> converted value
    problems: list = field(default_factory=list)


def _toml_type(value) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", dict: "table",
            list: "array"}.get(type(value), type(value).__name__)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _mount_text(kind: str, value) -> str:
    """The -o text of a TOML value, or ConfigError when its TOML type does not fit the option."""
    if kind == "flag":
        ok = isinstance(value, bool)
        text = "1" if value is True else "0"
    elif kind == "size":
        ok = isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
        text = str(value)
    elif kind in ("float", "rate", "int"):
        ok = _is_number(value) if kind != "int" else isinstance(value, int) and not isinstance(value, bool)
        text = repr(value)
    else:
        ok = isinstance(value, str)
        text = value if ok else ""
    if not ok:
        want = _WANT.get(kind, "a string")
        raise ConfigError(f"want {want}, got {_toml_type(value)} {value!r}")
    return text


def _converted(name: str, kind: str, value):
    """``value`` through the command line's converter; ConfigError says what is wrong with it."""
    try:
        return _convert(name, kind, _mount_text(kind, value))
    except ConfigError as exc:
        # the converter speaks of "option NAME ..."; the caller already names the key
        raise ConfigError(str(exc).removeprefix(f"option {name}: ").removeprefix(f"option {name} ")) from None


def controller_actions(parser: argparse.ArgumentParser) -> dict:
    """The controller's flags that a config file may set: argparse dest -> action."""
    return {a.dest: a for a in parser._actions
            if a.option_strings and a.dest not in ("help", "config")}


def _controller_value(name: str, action: argparse.Action, value):
    """A [controller] value, converted as argparse converts the flag (plus the stricter mount-option kinds)."""
    if action.nargs == 0:  # store_true / store_false
        if not isinstance(value, bool):
            raise ConfigError(f"want true or false, got {_toml_type(value)} {value!r}")
        return value  # the key is the dest: `flag = true` sets it, whichever way the flag spells it
    numeric = action.type in (int, float)
    if numeric and not (_is_number(value) and (action.type is float or isinstance(value, int))):
        raise ConfigError(f"want a {'whole ' if action.type is int else ''}number, got {_toml_type(value)} {value!r}")
    if not numeric and not isinstance(value, str):
        raise ConfigError(f"want a string, got {_toml_type(value)} {value!r}")
    if name in CONTROLLER_KINDS:
        _converted(name, CONTROLLER_KINDS[name], value)
    if action.type is not None:
        assert callable(action.type)  # argparse also takes a registered type's name; these flags name none
        try:
            value = action.type(value if not numeric else repr(value))
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            raise ConfigError(f"bad value {value!r}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return value


def read_config(path: str, controller: dict) -> ConfigFile:
    """Read and check ``path``; never raises for what is in the file: see ``.problems``.

    ``controller`` is ``controller_actions(parser)`` of `aiturbo controller`.
    """
    cf = ConfigFile(path=path)
    try:
        with open(path, "rb") as f:
            raw = f.read(CONFIG_FILE_BYTES_MAX + 1)
    except OSError as exc:
        cf.problems.append(f"{path}: cannot read the config file: {exc.strerror}")
        return cf
    if len(raw) > CONFIG_FILE_BYTES_MAX:
        cf.problems.append(f"{path}: larger than {CONFIG_FILE_BYTES_MAX} bytes: is it the config file?")
        return cf
    try:
        doc = tomllib.loads(raw.decode())
    except UnicodeDecodeError as exc:
        cf.problems.append(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})")
        return cf
    except tomllib.TOMLDecodeError as exc:
        cf.problems.append(f"{path}: not valid TOML: {exc}")
        return cf
    for key, value in doc.items():
        if key in TABLES:
            if not isinstance(value, dict):
                cf.problems.append(f"{path}: {key} must be a table ([{key}]), got {_toml_type(value)}")
                continue
            cf.tables.add(key)
            _read_table(cf, key, value, controller)
        elif key in TOP_KEYS:
            try:
                setattr(cf, key, _converted(key, TOP_KEYS[key], value))
            except ConfigError as exc:
                cf.problems.append(f"{path}: {key}: {exc}")
        else:
            known = ", ".join([*TOP_KEYS, *(f"[{t}]" for t in TABLES)])
            cf.problems.append(f"{path}: unknown key {key!r} (the top level has {known})")
    return cf


def _read_table(cf: ConfigFile, table: str, items: dict, controller: dict) -> None:
    for key, value in items.items():
        where = f"{cf.path}: [{table}] {key}"
        try:
            if table == "mount":
                spec = OPTIONS.get(key)
                if spec is None:
                    raise ConfigError("unknown mount option (mount.aiturbo --help lists them)")
                cf.mount[key] = _converted(key, spec[0], value)
            else:
                action = controller.get(key)
                if action is None:
                    raise ConfigError(f"unknown controller setting (known: {', '.join(controller)})")
                cf.controller[key] = _controller_value(key, action, value)
        except ConfigError as exc:
            cf.problems.append(f"{where}: {exc}")


def load_config(path: str, controller: dict) -> ConfigFile:
    """``read_config``, raising one ConfigError that lists every problem."""
    cf = read_config(path, controller)
    if cf.problems:
        raise ConfigError("\n".join(cf.problems))
    return cf


def split_config_option(options: list[str]) -> tuple[str | None, str]:
    """Take ``config=FILE`` out of -o strings (fstab names the file that way): (FILE or None, the rest)."""
    paths, rest = set(), []
    for text in options:
        for item in filter(None, (s.strip() for s in text.split(","))):
            if item.startswith("config="):
                paths.add(item[len("config="):])
            elif item == "config":
                raise ConfigError("option config needs a value: config=FILE")
            else:
                rest.append(item)
    if len(paths) > 1:
        raise ConfigError(f"option config given twice with different files: {', '.join(sorted(paths))}")
    return (paths.pop() if paths else None), ",".join(rest)


def mount_settings(cf: ConfigFile | None, backend: str | None, mountpoint: str | None,
                   cli_options: dict) -> tuple[str, str, dict]:
    """(backend, mountpoint, options): the command line over the file."""
    if (backend is None) != (mountpoint is None):
        raise ConfigError("give BACKEND and MOUNTPOINT both, or neither (then the config file names them)")
    if backend is None and cf is not None:
        backend = cf.backend
    if mountpoint is None and cf is not None:
        mountpoint = cf.mountpoint
    if not (backend and mountpoint):
        if cf is None:  # an empty BACKEND or MOUNTPOINT on the command line, and no file
            raise ConfigError("give BACKEND MOUNTPOINT, or a config file that names them (--config FILE)")
        if not backend:
            raise ConfigError(f"no backend: give BACKEND MOUNTPOINT, or set backend = \"URL\" in {cf.path}")
        raise ConfigError(f"no mount point: give BACKEND MOUNTPOINT, or set mountpoint = \"DIR\" in {cf.path}")
    return backend, mountpoint, {**(cf.mount if cf else {}), **cli_options}


# --- `aiturbo config check` ---------------------------------------------------------------------

def _size_text(n: int) -> str:
    for unit, size in (("T", 1024 * GiB), ("G", GiB), ("M", MiB), ("K", KiB)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


# The password of a URL's user info (postgresql://user:PASSWORD@host/db).
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*:)[^@\s]*(?P<at>@)")


def _show(value) -> str:
    """A setting as `config check` prints it; a password in a URL is masked."""
    if value is None:
        return "(not set)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return _URL_PASSWORD.sub(r"\g<head>***\g<at>", str(value))


# option -> how its effective value reads off NodeConfig, where the field is not the option's name
_NODE_FIELDS = {
    "dram": lambda c: _size_text(c.dram_bytes),
    "fsync": lambda c: "durable" if c.fsync_durable else "staged",
    "drain_timeout": lambda c: c.drain_timeout_s,
    "import_ttl": lambda c: c.import_ttl_s,
    "persist_retry_window": lambda c: c.persist_retry_window_s,
    "persist_yield": lambda c: c.persist_yield_s,
    "full_backend_wait": lambda c: c.full_backend_wait_s,
    "ro": lambda c: c.read_only,
}


def _node_value(cfg, name: str):
    if name in _NODE_FIELDS:
        return _NODE_FIELDS[name](cfg)
    if name.startswith("s3_"):
        return cfg.backend_options.get(name, False if OPTIONS[name][0] == "flag" else None)
    return getattr(cfg, name, None)


def settings_lines(cf: ConfigFile, controller: dict) -> list[str]:
    """The effective settings of a file, one line each; values the file does not set say (default).

    Checks the [mount] options together, as mount.aiturbo would (e.g. fabric=
    needs secret_file=), adding any problem to ``cf.problems``.
    """
    lines = []
    show_mount = "mount" in cf.tables or cf.backend or cf.mountpoint or "controller" not in cf.tables
    if show_mount:
        for key in TOP_KEYS:
            value = getattr(cf, key)
            lines.append(f"{key} = {_show(value)}" + ("" if value else "  (give it on the mount.aiturbo command line)"))
        try:
            node = build_config(cf.backend or "file:///", cf.mountpoint or "/", cf.mount, foreground=False)
        except AiturboError as exc:
            cf.problems.append(f"{cf.path}: [mount] {exc}")
            node = None
        for name, (kind, _) in OPTIONS.items():
            if name in cf.mount:
                value = cf.mount[name]
                lines.append(f"[mount] {name} = {_size_text(value) if kind == 'size' else _show(value)}")
            else:
                lines.append(f"[mount] {name} = {_show(_node_value(node, name)) if node else '?'}  (default)")
    if "controller" in cf.tables or not show_mount:
        for name, action in controller.items():
            if name in cf.controller:
                lines.append(f"[controller] {name} = {_show(cf.controller[name])}")
            elif action.default is None and name in ("listen", "meta", "secret_file"):
                lines.append(f"[controller] {name} = (not set)  (give it on the aiturbo controller command line)")
            else:
                lines.append(f"[controller] {name} = {_show(action.default)}  (default)")
    return lines


def check(path: str, controller: dict, out, err) -> int:
    """`aiturbo config check`: print the effective settings; 0 when the file is valid, else 1 and every problem."""
    cf = read_config(path, controller)
    lines = settings_lines(cf, controller) if cf.tables or cf.backend or cf.mountpoint or not cf.problems else []
    if cf.problems:
        for problem in cf.problems:
            print(f"aiturbo config check: {problem}", file=err)
        print(f"aiturbo config check: {path}: {len(cf.problems)} problem(s)", file=err)
        return 1
    for line in lines:
        print(line, file=out)
    print(f"{os.path.abspath(path)}: valid", file=out)
    return 0
