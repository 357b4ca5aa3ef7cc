"""Unmodified programs on a real aiturbofs mount.

Each test runs a tool the way a user would (cp -a, dd, rsync, tar, fio,
torch.save, PyTorch DCP, safetensors), checks that what it reads back equals
what was written, that the files become durable, and that the backend copy
holds exactly the original bytes (and nothing else: no temp names left by
the tool or by the persister).
"""

import os
import random
import shutil
import stat
import subprocess
import time

import pytest
from mounting import wait_state
from trees import files_of, tree, verify_persisted

MiB = 1 << 20
CHUNK = 8 * MiB


def make_source_tree(root, rng: random.Random) -> dict:
    """A small tree with files crossing the chunk size, modes, a symlink."""
    root = str(root)
    files = {
        "a.bin": rng.randbytes(CHUNK + 12345),  # crosses the 8 MiB chunk boundary
        "small.txt": b"hello\n",
        "empty": b"",
        "sub/b.bin": rng.randbytes(300_000),
        "sub/deeper/c.bin": rng.randbytes(2 * MiB + 1),
        "sub/deeper/zeros.bin": bytes(MiB),
        "odd name with spaces.dat": rng.randbytes(777),
    }
    for rel, data in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    os.chmod(os.path.join(root, "small.txt"), 0o600)
    os.chmod(os.path.join(root, "sub/b.bin"), 0o755)
    os.symlink("sub/b.bin", os.path.join(root, "link-to-b"))
    os.utime(os.path.join(root, "a.bin"), ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
    return files


def wait_all_durable(root, rels, timeout_s: float = 60.0) -> None:
    for rel in rels:
        path = os.path.join(str(root), rel)
        assert wait_state(path, "durable", timeout_s) == "durable", rel


def backend_files(tmp_path, under: str = "") -> dict:
    root = tmp_path / "backend" / under if under else tmp_path / "backend"
    return files_of(tree(root))


def as_str_keys(d: dict) -> dict:
    return {os.fsdecode(k): v for k, v in d.items()}


def run(cmd, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert out.returncode == 0, f"{cmd} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return out


# ---------------------------------------------------------------- coreutils
def test_cp_a_tree(make_mount, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    files = make_source_tree(src, random.Random(1))
    m = make_mount()
    out = run(["cp", "-a", str(src), m.path("copy")])
    assert out.stderr == ""  # no complaint about xattrs/ACLs (EOPNOTSUPP is "none here")
    dst = m.path("copy")
    assert tree(dst) == tree(src)
    for rel in ("small.txt", "sub/b.bin", "a.bin"):
        s, d = os.stat(src / rel), os.stat(os.path.join(dst, rel))
        assert stat.S_IMODE(d.st_mode) == stat.S_IMODE(s.st_mode), rel
        assert d.st_mtime_ns == s.st_mtime_ns, rel
    assert os.readlink(os.path.join(dst, "link-to-b")) == "sub/b.bin"
    wait_all_durable(dst, files)
    assert as_str_keys(backend_files(tmp_path, "copy")) == files
    # and back out of the mount
    run(["cp", "-a", dst, str(tmp_path / "back")])
    assert tree(tmp_path / "back") == tree(src)
    verify_persisted(make_mount, m, tmp_path)


def test_dd_fsync(make_mount, tmp_path):
    rng = random.Random(2)
    src = tmp_path / "src.bin"
    data = rng.randbytes(CHUNK + 3 * MiB + 100)  # not a multiple of bs
    src.write_bytes(data)
    m = make_mount()
    out = run(["dd", f"if={src}", f"of={m.path('dd.bin')}", "bs=1M", "conv=fsync", "status=none"])
    assert out.stderr == ""
    with open(m.path("dd.bin"), "rb") as f:
        assert f.read() == data
    # dd with oflag=direct and a seek into an existing file (conv=notrunc)
    run(["dd", f"if={src}", f"of={m.path('dd.bin')}", "bs=1M", "count=2", "seek=9", "conv=notrunc,fsync",
         "oflag=direct", "status=none"])
    want = bytearray(data)
    want[9 * MiB : 11 * MiB] = data[: 2 * MiB]
    want = bytes(want)  # the file is longer than 11 MiB: no growth
    out = run(["dd", f"if={m.path('dd.bin')}", f"of={tmp_path / 'readback.bin'}", "bs=1M", "status=none"])
    assert (tmp_path / "readback.bin").read_bytes() == want
    wait_all_durable(m.mountpoint, ["dd.bin"])
    assert (tmp_path / "backend" / "dd.bin").read_bytes() == want
    verify_persisted(make_mount, m, tmp_path)


def test_rsync_a(make_mount, tmp_path):
    if shutil.which("rsync") is None:
        pytest.skip("rsync is not installed (apt-get install rsync)")
    src = tmp_path / "src"
    src.mkdir()
    files = make_source_tree(src, random.Random(3))
    m = make_mount()
    dst = m.path("rs")
    run(["rsync", "-a", f"{src}/", f"{dst}/"])
    assert tree(dst) == tree(src)
    wait_all_durable(dst, files)
    # a second run after changes: rsync writes .name.XXXXXX temps and renames
    # them over the (durable) files; deletes what vanished
    rng = random.Random(4)
    files["sub/b.bin"] = rng.randbytes(300_001)
    (src / "sub" / "b.bin").write_bytes(files["sub/b.bin"])
    a = bytearray(files["a.bin"])
    a[CHUNK - 10 : CHUNK + 10] = b"X" * 20
    files["a.bin"] = bytes(a)
    (src / "a.bin").write_bytes(files["a.bin"])
    os.unlink(src / "small.txt")
    del files["small.txt"]
    run(["rsync", "-a", "--delete", f"{src}/", f"{dst}/"])
    assert tree(dst) == tree(src)
    wait_all_durable(dst, files)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and as_str_keys(backend_files(tmp_path, "rs")) != files:
        time.sleep(0.1)
    assert as_str_keys(backend_files(tmp_path, "rs")) == files  # no rsync temp files, no stale ones
    # rsync back out checks the reads (whole-file, verified by rsync's checksum)
    run(["rsync", "-a", "--checksum", f"{dst}/", f"{tmp_path / 'back'}/"])
    assert tree(tmp_path / "back") == tree(src)
    verify_persisted(make_mount, m, tmp_path)


def test_tar_c_x(make_mount, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    files = make_source_tree(src, random.Random(5))
    m = make_mount()
    run(["tar", "cf", m.path("t.tar"), "-C", str(src), "."])
    os.mkdir(m.path("x"))
    run(["tar", "xf", m.path("t.tar"), "-C", m.path("x")])
    assert tree(m.path("x")) == tree(src)
    # and a tar made outside, extracted from the mount to local disk
    run(["tar", "cf", str(tmp_path / "local.tar"), "-C", str(src), "."])
    with open(m.path("t.tar"), "rb") as f:
        mounted_tar = f.read()
    os.mkdir(tmp_path / "out")
    run(["tar", "xf", m.path("t.tar"), "-C", str(tmp_path / "out")])
    assert tree(tmp_path / "out") == tree(src)
    wait_all_durable(m.path("x"), files)
    wait_all_durable(m.mountpoint, ["t.tar"])
    assert (tmp_path / "backend" / "t.tar").read_bytes() == mounted_tar
    assert as_str_keys(backend_files(tmp_path, "x")) == files
    verify_persisted(make_mount, m, tmp_path)


# ---------------------------------------------------------------------- fio
def _fio(args, cwd) -> str:
    # cwd: fio drops a verify state file there; not in the checkout
    return run(["fio", "--output-format=terse", "--verify_state_save=0", *args], cwd=cwd).stdout


def test_fio_write_and_randwrite_verify(make_mount, tmp_path):
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed (apt-get install fio)")
    m = make_mount()
    os.mkdir(m.path("fio"))
    d = m.path("fio")
    _fio(["--name=w", "--rw=write", "--bs=1M", "--size=64M", f"--directory={d}", "--end_fsync=1"], tmp_path)
    _fio(["--name=rw", "--rw=randwrite", "--bs=64k", "--size=24M", f"--directory={d}", "--verify=crc32c",
          "--do_verify=1", "--verify_fatal=1", "--randseed=7"], tmp_path)
    # a reader run over what was written: fio verifies the headers again
    _fio(["--name=rw", "--rw=randread", "--bs=64k", "--size=24M", f"--directory={d}", "--verify=crc32c",
          "--verify_only", "--verify_fatal=1", "--randseed=7"], tmp_path)
    names = sorted(os.listdir(d))
    assert names == ["rw.0.0", "w.0.0"]
    assert os.stat(os.path.join(d, "w.0.0")).st_size == 64 * MiB
    assert os.stat(os.path.join(d, "rw.0.0")).st_size == 24 * MiB
    wait_all_durable(d, names)
    for n in names:
        with open(os.path.join(d, n), "rb") as f:
            assert (tmp_path / "backend" / "fio" / n).read_bytes() == f.read(), n
    verify_persisted(make_mount, m, tmp_path)


# -------------------------------------------------------------------- torch
def _state_dict(torch):
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(3 * 1024 * 1024, generator=g),  # 12 MiB: crosses a chunk boundary
        "w": torch.randn(64, 128, generator=g),
        "ints": torch.arange(1000, dtype=torch.int64),
        "half": torch.randn(4096, generator=g).to(torch.bfloat16),
        "step": torch.tensor(1234),
    }


def _assert_same(torch, a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def test_torch_save_load(make_mount, tmp_path):
    torch = pytest.importorskip("torch")
    m = make_mount()
    sd = _state_dict(torch)
    p = m.path("ckpt.pt")
    torch.save(sd, p)
    _assert_same(torch, sd, torch.load(p, weights_only=True))
    loaded = torch.load(p, weights_only=True, mmap=True)  # mmap of the mounted file
    _assert_same(torch, sd, loaded)
    del loaded
    # overwrite in place with a new step, as a training loop does
    sd["step"] = torch.tensor(1235)
    sd["w"] = sd["w"] * 2
    torch.save(sd, p)
    _assert_same(torch, sd, torch.load(p, weights_only=True, mmap=True))
    assert wait_state(p, "durable") == "durable"
    # a smaller checkpoint over the bigger one: open("wb") must truncate
    small = {"step": torch.tensor(7), "w": torch.ones(3)}
    torch.save(small, m.path("other.pt"))
    torch.save(sd, m.path("other.pt"))
    torch.save(small, m.path("other.pt"))
    _assert_same(torch, small, torch.load(m.path("other.pt"), weights_only=True))
    assert wait_state(m.path("other.pt"), "durable") == "durable"
    _assert_same(torch, small, torch.load(tmp_path / "backend" / "other.pt", weights_only=True))
    _assert_same(torch, sd, torch.load(tmp_path / "backend" / "ckpt.pt", weights_only=True))
    with open(p, "rb") as f:
        assert (tmp_path / "backend" / "ckpt.pt").read_bytes() == f.read()
    verify_persisted(make_mount, m, tmp_path)


def test_torch_dcp_save_load(make_mount, tmp_path):
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    import warnings

    m = make_mount()
    sd = _state_dict(torch)
    ckpt = m.path("dcp", "step-1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: single process" notes
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(ckpt, sync_files=True))
        target = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(target, checkpoint_id=ckpt)
    _assert_same(torch, sd, target)
    names = sorted(os.listdir(ckpt))
    assert ".metadata" in names and any(n.endswith(".distcp") for n in names)
    wait_all_durable(ckpt, names)
    for n in names:
        with open(os.path.join(ckpt, n), "rb") as f:
            assert (tmp_path / "backend" / "dcp" / "step-1" / n).read_bytes() == f.read(), n
    # the backend copy alone is a loadable checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(again, checkpoint_id=str(tmp_path / "backend" / "dcp" / "step-1"))
    _assert_same(torch, sd, again)
    # the plain form: dcp.save(state_dict, checkpoint_id=dir) picks FileSystemWriter itself
    sd["step"] = torch.tensor(2)
    ckpt2 = m.path("dcp", "step-2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=ckpt2)
        target = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(target, checkpoint_id=ckpt2)
    _assert_same(torch, sd, target)
    wait_all_durable(ckpt2, os.listdir(ckpt2))
    verify_persisted(make_mount, m, tmp_path)


def test_safetensors(make_mount, tmp_path):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    m = make_mount()
    sd = {k: v.contiguous() for k, v in _state_dict(torch).items()}
    p = m.path("model.safetensors")
    st.save_file(sd, p, metadata={"format": "pt"})
    _assert_same(torch, sd, st.load_file(p))
    with safe_open(p, framework="pt") as f:  # mmaps the file
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(sd)
        for k in sd:
            assert torch.equal(f.get_tensor(k), sd[k]), k
        part = f.get_slice("big")[1000:2000]
        assert torch.equal(part, sd["big"][1000:2000])
    assert wait_state(p, "durable") == "durable"
    with open(p, "rb") as f:
        assert (tmp_path / "backend" / "model.safetensors").read_bytes() == f.read()
    _assert_same(torch, sd, st.load_file(tmp_path / "backend" / "model.safetensors"))
    verify_persisted(make_mount, m, tmp_path)
