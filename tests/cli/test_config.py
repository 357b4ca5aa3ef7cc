"""The TOML config file: parsing, `aiturbo config check`, mounts and the controller started from it, the units."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import trio
from mounting import REPO, aiturbo, is_mounted

from aiturbofs._limits import CONFIG_PATH_DEFAULT, DRAIN_TIMEOUT_S_DEFAULT
from aiturbofs.cli._config import mount_settings, read_config, split_config_option
from aiturbofs.cli._journal import JournalFormatter
from aiturbofs.cli.main import controller_actions
from aiturbofs.node import parse_options
from aiturbofs.node._options import OPTIONS

ENV = dict(os.environ, PYTHONPATH=REPO)
SECRET = b"correct horse battery staple 42!"
SYSTEMD = os.path.join(REPO, "systemd")
SAMPLE = os.path.join(SYSTEMD, "aiturbo.toml.example")

# one valid value per option kind: (TOML text, the same value as -o text)
VALUE_OF_KIND = {
    "flag": ("true", None), "size": ('"96M"', "96M"), "float": ("1.5", "1.5"), "int": ("2", "2"),
    "rate": ("12.5", "12.5"), "addr": ('"127.0.0.1:7000"', "127.0.0.1:7000"), "path": ('"/x/y"', "/x/y"),
    "str": ('"text"', "text"),
}


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _actions() -> dict:
    return controller_actions()


def _value_of(kind: str) -> tuple[str, str | None]:
    if kind.startswith("choice:"):
        choice = kind[7:].split("|")[-1]
        return f'"{choice}"', choice
    return VALUE_OF_KIND.get(kind, VALUE_OF_KIND["str"])


# --- parsing ------------------------------------------------------------------------------------


def test_every_mount_option_is_a_key_and_means_what_it_means_on_the_command_line(tmp_path):
    lines, cli = ["[mount]"], []
    for name, (kind, _) in OPTIONS.items():
        toml, text = _value_of(kind)
        lines.append(f"{name} = {toml}")
        cli.append(name if text is None else f"{name}={text}")
    cf = read_config(_write(tmp_path / "all.toml", "\n".join(lines) + "\n"), _actions())
    assert cf.problems == []
    assert cf.mount == parse_options(",".join(cli))
    assert set(cf.mount) == set(OPTIONS)


def test_sizes_take_bytes_or_text_and_flags_can_be_false(tmp_path):
    cf = read_config(_write(tmp_path / "c.toml", '[mount]\ndram = 100663296\nspill = "/s"\nsync_close = false\n'
                                                 'allow_other = true\n'), _actions())
    assert cf.problems == []
    assert cf.mount == {"dram": 96 << 20, "spill": "/s", "sync_close": False, "allow_other": True}


def test_every_problem_is_named_by_file_table_and_key(tmp_path):
    path = _write(tmp_path / "bad.toml", """\
backend = 7
mountpoint = "relative/dir"
colour = "blue"
[mount]
dram = "lots"
sync_close = "yes"
drain_timeout = "600"
replicas = true
fsync = "sometimes"
no_such_option = 1
[controller]
listen = "no-port"
backend_gbps = -1
log_level = "loud"
plan_b = 1
""")
    cf = read_config(path, _actions())
    want = [
        f"{path}: backend: want a string, got integer 7",
        f"{path}: mountpoint: needs an absolute path, got 'relative/dir'",
        f"{path}: unknown key 'colour'",
        f"{path}: [mount] dram: bad size 'lots'",
        f"{path}: [mount] sync_close: want true or false, got string 'yes'",
        f"{path}: [mount] drain_timeout: want a number of seconds, got string '600'",
        f"{path}: [mount] replicas: want a whole number, got boolean True",
        f"{path}: [mount] fsync: must be one of staged, durable, got 'sometimes'",
        f"{path}: [mount] no_such_option: unknown mount option",
        f"{path}: [controller] listen: needs HOST:PORT, got 'no-port'",
        f"{path}: [controller] backend_gbps: needs a rate in Gbit/s above 0, got '-1'",
        f"{path}: [controller] log_level: must be one of debug, info, warning, error, got 'loud'",
        f"{path}: [controller] plan_b: unknown controller setting",
    ]
    assert len(cf.problems) == len(want), cf.problems
    for problem, start in zip(cf.problems, want):
        assert problem.startswith(start), (problem, start)


def test_a_table_that_is_not_a_table_and_bad_toml(tmp_path):
    cf = read_config(_write(tmp_path / "a.toml", 'mount = "dram=1G"\n'), _actions())
    assert cf.problems == [f"{tmp_path}/a.toml: mount must be a table ([mount]), got string"]
    cf = read_config(_write(tmp_path / "b.toml", '[mount]\ndram = 64G\n'), _actions())
    assert len(cf.problems) == 1 and "not valid TOML" in cf.problems[0] and "line 2" in cf.problems[0]
    cf = read_config(str(tmp_path / "missing.toml"), _actions())
    assert cf.problems == [f"{tmp_path}/missing.toml: cannot read the config file: No such file or directory"]


def test_the_command_line_overrides_the_file(tmp_path):
    cf = read_config(_write(tmp_path / "c.toml", 'backend = "file:///from/file"\nmountpoint = "/mnt/file"\n'
                                                 '[mount]\ndram = "64M"\nfsync = "durable"\n'), _actions())
    assert cf.problems == []
    assert mount_settings(cf, None, None, parse_options("dram=80M")) == (
        "file:///from/file", "/mnt/file", {"dram": 80 << 20, "fsync": "durable"})
    assert mount_settings(cf, "file:///cli", "/mnt/cli", {"sync_close": True}) == (
        "file:///cli", "/mnt/cli", {"dram": 64 << 20, "fsync": "durable", "sync_close": True})
    with pytest.raises(Exception, match="BACKEND and MOUNTPOINT both, or neither"):
        mount_settings(cf, "file:///cli", None, {})
    with pytest.raises(Exception, match="no backend"):
        mount_settings(read_config(_write(tmp_path / "d.toml", "[mount]\n"), _actions()), None, None, {})
    with pytest.raises(Exception, match="config file that names them"):
        mount_settings(None, None, None, {})


def test_config_comes_out_of_the_o_options(tmp_path):
    assert split_config_option(["_netdev,config=/etc/a.toml", "dram=1G"]) == ("/etc/a.toml", "_netdev,dram=1G")
    assert split_config_option(["dram=1G"]) == (None, "dram=1G")
    with pytest.raises(Exception, match="different files"):
        split_config_option(["config=/a,config=/b"])


# --- aiturbo config check -------------------------------------------------------------------------


def test_check_prints_the_effective_settings_of_the_sample(tmp_path):
    r = aiturbo("config", "check", SAMPLE, check=False)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == f"{SAMPLE}: valid"
    assert "backend = s3://bucket/ckpt" in lines
    assert "[mount] dram = 64G" in lines and "[mount] drain_timeout = 600" in lines
    assert "[mount] import_ttl = 5  (default)" in lines and "[mount] sync_close = false  (default)" in lines
    assert "[controller] backend_gbps = 100" in lines and "[controller] log_level = info  (default)" in lines
    assert sorted(line.split()[1] for line in lines if line.startswith("[mount] ")) == sorted(OPTIONS)


def test_check_exits_1_listing_every_problem(tmp_path):
    path = _write(tmp_path / "bad.toml", '[mount]\ndram = "lots"\nsync_close = "yes"\nfabric = "127.0.0.1:7701"\n')
    r = aiturbo("config", "check", path, check=False)
    assert r.returncode == 1
    assert f"{path}: [mount] dram: bad size 'lots'" in r.stderr
    assert f"{path}: [mount] sync_close: want true or false" in r.stderr
    # options checked together, as mount.aiturbo would
    assert f"{path}: [mount] fabric= needs secret_file=" in r.stderr
    assert "3 problem(s)" in r.stderr and "valid" not in r.stdout
    r = aiturbo("config", "check", str(tmp_path / "nope.toml"), check=False)
    assert r.returncode == 1 and "cannot read the config file" in r.stderr


def test_check_without_a_file_names_the_default_path():
    r = aiturbo("config", "check", "--help")
    assert CONFIG_PATH_DEFAULT in r.stdout


def test_mount_helper_refuses_a_bad_file_before_mounting(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    path = _write(tmp_path / "bad.toml", f'backend = "file://{tmp_path}"\nmountpoint = "{mnt}"\n'
                                         '[mount]\ndram = "lots"\nfsync = "sometimes"\n')
    r = subprocess.run([sys.executable, "-m", "aiturbofs.cli.mount", "--config", path, "-f"],
                       check=False, capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 1
    assert f"mount.aiturbo: {path}: [mount] dram: bad size 'lots'" in r.stderr
    assert f"mount.aiturbo: {path}: [mount] fsync: must be one of staged, durable" in r.stderr
    assert not is_mounted(str(mnt))


# --- real mounts from a config file -----------------------------------------------------------------


def _stop(proc: subprocess.Popen | None, mnt: str) -> None:
    """Unmount, let the daemon drain and exit; whatever happens, leave no mount and no process behind."""
    try:
        if is_mounted(mnt):
            subprocess.run(["fusermount3", "-u", mnt], check=False, capture_output=True)
        if proc is not None and proc.poll() is None:
            if is_mounted(mnt):
                proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if is_mounted(mnt):
            subprocess.run(["fusermount3", "-u", "-z", mnt], check=False, capture_output=True)


def _wait_mounted(mnt: str, proc: subprocess.Popen | None, log_path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not is_mounted(mnt):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"mount.aiturbo exited with {proc.returncode}:\n{log_path.read_text()}")
        assert time.monotonic() < deadline, f"no mount in {timeout_s} s:\n{log_path.read_text()}"
        time.sleep(0.05)


@pytest.mark.fuse
def test_a_mount_from_the_config_file_logs_to_the_journal(tmp_path):
    backend, mnt = tmp_path / "backend", tmp_path / "mnt"
    backend.mkdir()
    mnt.mkdir()
    path = _write(tmp_path / "aiturbo.toml", f"""\
backend = "file://{backend}"
mountpoint = "{mnt}"
[mount]
state_dir = "{tmp_path}/state"
dram = "96M"
import_ttl = 0.5
""")
    log_path = tmp_path / "journal.log"
    proc = None
    with open(log_path, "wb") as log:
        st = os.fstat(log.fileno())
        # what systemd sets when stderr is the journal: the daemon then logs in the journal's format
        env = dict(ENV, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
        try:
            proc = subprocess.Popen([sys.executable, "-m", "aiturbofs.cli.mount", "--config", path, "-f"],
                                    stdout=log, stderr=subprocess.STDOUT, env=env)
            _wait_mounted(str(mnt), proc, log_path)
            data = os.urandom(3 << 20)
            (mnt / "ckpt.bin").write_bytes(data)
            assert (mnt / "ckpt.bin").read_bytes() == data
            assert "of 96.0 MiB" in aiturbo("status", str(mnt)).stdout  # the file's dram=
        finally:
            _stop(proc, str(mnt))
    assert proc.returncode == 0, log_path.read_text()
    assert (backend / "ckpt.bin").read_bytes() == data
    lines = log_path.read_text().splitlines()
    mounted = [line for line in lines if "mounted" in line and str(mnt) in line]
    assert mounted and mounted[0].startswith("<6>INFO "), lines
    assert not any(re.match(r"<\d>\d{4}-\d\d-\d\d", line) for line in lines), "the journal stamps lines itself"


def _mount_helper() -> str | None:
    return shutil.which("mount.aiturbo", path="/sbin:/usr/sbin")


@pytest.mark.fuse
@pytest.mark.skipif(shutil.which("mount") is None or _mount_helper() is None,
                    reason="mount(8) or /sbin/mount.aiturbo missing (scripts/setup.sh links the helper)")
def test_fstab_style_mount_names_the_file_with_o_config(tmp_path):
    backend, mnt = tmp_path / "backend", tmp_path / "mnt"
    backend.mkdir()
    mnt.mkdir()
    state = tmp_path / "state"
    path = _write(tmp_path / "aiturbo.toml", f'[mount]\nstate_dir = "{state}"\ndram = "96M"\nimport_ttl = 0.5\n')
    # as an fstab line `file://B M aiturbo _netdev,config=FILE,dram=80M 0 0` makes mount(8) run it
    r = subprocess.run(["mount", "-t", "aiturbo", f"file://{backend}", str(mnt), "-o", f"_netdev,config={path},dram=80M"],
                       check=False, capture_output=True, text=True, env=ENV, timeout=120, cwd="/")
    try:
        assert r.returncode == 0, r.stderr
        assert is_mounted(str(mnt)), "exit 0 must mean mounted"
        data = os.urandom(1 << 20)
        (mnt / "f.bin").write_bytes(data)
        assert (mnt / "f.bin").read_bytes() == data
        assert "of 80.0 MiB" in aiturbo("status", str(mnt)).stdout  # the command line wins over the file's 96M
    finally:
        subprocess.run(["umount", str(mnt)], check=False, capture_output=True)
        deadline = time.monotonic() + 60
        pids = _daemon_pids(mnt)
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = _daemon_pids(mnt)
        for pid in pids:  # the drain did not end: kill the daemon this test started
            os.kill(pid, signal.SIGKILL)
        if is_mounted(str(mnt)):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False, capture_output=True)
    assert not pids, "the daemon did not exit after umount"
    assert (backend / "f.bin").read_bytes() == data
    assert "drain complete" in (state / "aiturbo.log").read_text()  # the file's state_dir=


def _daemon_pids(mnt) -> list[int]:
    r = subprocess.run(["pgrep", "-f", f"{mnt} "], check=False, capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


# --- the controller -----------------------------------------------------------------------------------


def _meta_has_membership() -> bool:
    import inspect

    from aiturbofs.meta._sqlite import SqliteMetaStore

    return not inspect.isabstract(SqliteMetaStore)


@pytest.mark.skipif(not _meta_has_membership(), reason="the SQLite engine has no membership calls yet")
async def test_controller_from_the_config_file_serves_nodes(tmp_path):
    from aiturbofs.fabric import TcpTransport

    secret = tmp_path / "secret"
    secret.write_bytes(SECRET + b"\n")
    secret.chmod(0o600)
    path = _write(tmp_path / "aiturbo.toml", f"""\
[controller]
listen = "127.0.0.1:0"
meta = "sqlite:///{tmp_path}/meta.db"
secret_file = "{secret}"
backend_gbps = 10
log_level = "info"
""")
    proc = subprocess.Popen([sys.executable, "-m", "aiturbofs.cli.main", "controller", "--config", path,
                             "--backend-gbps", "7"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        line = proc.stdout.readline()
        assert line.startswith("controller listening on 127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        address = line.split()[-1]

        async def main():
            with trio.fail_after(20):
                async with TcpTransport("n1", SECRET, host="127.0.0.1", port=0) as transport:
                    peer = await transport.connect(address)
                    join = {"op": "join", "node": "n1", "fabric": "n1:7387", "send_bw": 25e9, "recv_bw": 25e9,
                            "snic_bw": 12.5e9, "dram_free": 1 << 40}
                    assert (await peer.control(join))["ok"]
                    answer = await peer.control({"op": "heartbeat", "node": "n1"})
                    assert [n["node"] for n in answer["nodes"]] == ["n1"]

        await main()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "backend 7.0 Gbit/s" in err  # the flag wins over the file's 10
        assert "joined" in err and "n1" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_controller_without_listen_names_what_is_missing(tmp_path):
    path = _write(tmp_path / "aiturbo.toml", f'[controller]\nmeta = "sqlite:///{tmp_path}/meta.db"\n')
    r = aiturbo("controller", "--config", path, check=False, timeout=60)
    assert r.returncode == 2 and "--listen, --secret-file missing" in r.stderr
    r = aiturbo("controller", "--config", _write(tmp_path / "bad.toml", '[controller]\nlisten = 7700\n'),
                check=False, timeout=60)
    assert r.returncode == 1 and "[controller] listen: want a string, got integer 7700" in r.stderr


# --- logging to the journal -----------------------------------------------------------------------


def test_journal_lines_carry_the_syslog_priority():
    import logging

    fmt = JournalFormatter()
    record = logging.LogRecord("aiturbofs.node", logging.WARNING, __file__, 1, "slow %s", ("disk",), None)
    assert fmt.format(record) == "<4>WARNING aiturbofs.node: slow disk"
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "two\nlines", (), None)
    assert fmt.format(record) == "<3>ERROR x: two\n<3>lines"


# --- systemd units ----------------------------------------------------------------------------------


def _text(unit: str) -> str:
    with open(os.path.join(SYSTEMD, unit)) as f:
        return f.read()


def _unit(name: str) -> dict:
    out = {}
    for line in _text(name).splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and not line.startswith("#"):
            out[key] = value
    return out


def test_units_read_the_config_file_and_stop_after_the_drain():
    node, controller = _unit("aiturbo.service"), _unit("aiturbo-controller.service")
    assert node["ExecStart"].split()[1:] == ["--config", CONFIG_PATH_DEFAULT, "-f"]
    assert controller["ExecStart"].split()[1:] == ["controller", "--config", CONFIG_PATH_DEFAULT]
    sample = read_config(SAMPLE, _actions())
    for name in ("aiturbo.service", "aiturbo@.service"):
        unit = _unit(name)
        assert unit["Restart"] == "on-failure"
        stop_s = float(unit["TimeoutStopSec"])
        assert stop_s > DRAIN_TIMEOUT_S_DEFAULT and stop_s > sample.mount["drain_timeout"], name
        assert "drain_timeout" in _text(name), "the comment must say why"


def test_units_wait_for_the_daemons_readiness():
    """Type=notify: the node units are ready once the mount is up, the controller once it listens.  The
    notifying process is the one ExecStart runs (the node daemon stays in the foreground: -f)."""
    for name in ("aiturbo.service", "aiturbo@.service", "aiturbo-controller.service"):
        unit = _unit(name)
        assert (unit["Type"], unit["NotifyAccess"]) == ("notify", "main"), name
    for name in ("aiturbo.service", "aiturbo@.service"):
        assert "-f" in _unit(name)["ExecStart"].split(), name


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_the_units(tmp_path):
    for unit in ("aiturbo.service", "aiturbo-controller.service", "aiturbo@.service"):
        for line in _text(unit).splitlines():
            if line.startswith(("ExecStart=", "ExecStartPre=")):
                binary = line.split("=", 1)[1].split()[0]
                if not os.access(binary, os.X_OK):
                    pytest.skip(f"{binary} is not installed (scripts/setup.sh installs it): the units cannot verify")
        shutil.copy(os.path.join(SYSTEMD, unit), tmp_path / unit)
    names = [str(tmp_path / n) for n in ("aiturbo.service", "aiturbo-controller.service", "aiturbo@mnt-aiturbo.service")]
    r = subprocess.run(["systemd-analyze", "verify", *names], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "aiturbo" not in r.stderr, r.stderr  # no warning about our units


def test_check_masks_the_password_of_a_metadata_url(tmp_path):
    path = _write(tmp_path / "pw.toml", '[mount]\nmeta = "postgresql://aiturbo:hunter2-secret@10.0.0.1/aiturbo"\n'
                                        '[controller]\nmeta = "postgresql://ctl:other-secret@10.0.0.1/aiturbo"\n')
    r = aiturbo("config", "check", str(path), check=False)
    assert "hunter2-secret" not in r.stdout + r.stderr and "other-secret" not in r.stdout + r.stderr
    assert "[mount] meta = postgresql://aiturbo:***@10.0.0.1/aiturbo" in r.stdout.splitlines(), r.stdout
    assert "[controller] meta = postgresql://ctl:***@10.0.0.1/aiturbo" in r.stdout.splitlines(), r.stdout
