"""Operations: the Prometheus endpoint, `aiturbo status` for a person, structured log lines.

Every test mounts a real daemon and scrapes its endpoint over HTTP; the
figures must move as the data does (bytes written reach the backend once,
the queue empties, a backend outage shows as retries and a broken file).
"""

import os
import re
import secrets
import socket
import time
import urllib.error
import urllib.request

import pytest
from cluster import Cluster
from fileio import put
from mounting import aiturbo, status, wait_state
from s3server import S3Server
from scrape import scrape, value

from aiturbofs._limits import METRICS_NODE_ADDRESS_DEFAULT, MiB

DURABLE_WAIT_S = 60.0


# ------------------------------------------------------------------ helpers


def scrape_until(url: str, name: str, want: float, timeout_s: float = DURABLE_WAIT_S, **labels) -> dict:
    """Scrape until sample ``name{labels}`` is ``want``; the last scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = scrape(url)
        if value(s, name, **labels) == want:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}{labels} is {value(s, name, **labels)}, not {want}, after {timeout_s} s")
        time.sleep(0.1)


# ------------------------------------------------------------------ single node


def test_figures_follow_the_data(make_mount):
    m = make_mount(metrics="127.0.0.1:0", dram="64M")
    url = status(m)["metrics"]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url), url
    before = scrape(url)
    assert value(before, "aiturbo_pool_budget_bytes") == 64 * MiB
    assert value(before, "aiturbo_backend_bytes_total", direction="uploaded") == 0
    assert value(before, "aiturbo_persist_queue_files") == 0

    files = {f"f{i}.bin": os.urandom(3 * MiB + 1000 * i) for i in range(3)}
    for name, data in files.items():
        put(m.path(name), data)
    for name in files:
        assert wait_state(m.path(name), "durable", DURABLE_WAIT_S) == "durable"
    written = sum(map(len, files.values()))
    after = scrape_until(url, "aiturbo_persist_queue_files", 0)
    uploaded = value(after, "aiturbo_backend_bytes_total", direction="uploaded")
    assert written <= uploaded < written + MiB, (uploaded, written)  # each byte once (no re-upload)
    assert value(after, "aiturbo_files_persisted_total", result="durable") == len(files)
    assert value(after, "aiturbo_files_persisted_total", result="broken") == 0
    assert value(after, "aiturbo_errors_total", kind="backend_retry") == 0
    # durable: nothing is pinned any more; the bytes stay as read cache (clean), not dirty
    after = scrape_until(url, "aiturbo_pool_bytes", 0, state="dirty")
    assert value(after, "aiturbo_pool_pinned_chunks") == 0
    # (in DRAM, or, for files the kernel wrote, in their backing files on disk)
    assert value(after, "aiturbo_pool_bytes", state="clean") + value(after, "aiturbo_pool_bytes", state="disk_clean") > 0
    assert value(after, "aiturbo_pool_used_bytes") <= 64 * MiB
    # the cached bytes are in the backing files (huge pages may round them up to 2 MiB each)
    cached = value(after, "aiturbo_staging_allocated_bytes") + value(after, "aiturbo_staging_disk_allocated_bytes")
    assert written <= cached <= written + len(files) * 2 * MiB

    with open(m.path("f0.bin"), "rb") as f:
        assert f.read() == files["f0.bin"]
    # a structured line per persisted file: what, which file, how big, how long
    log = m.log()
    for name, data in files.items():
        assert re.search(rf"persisted path={re.escape(name)} size={len(data)} s=\d+\.\d+ version=\d+", log), log[-3000:]
    assert re.search(r"staged ino=\d+ version=\d+ size=\d+ holders=local", log), log[-3000:]

    # the endpoint answers only GET /metrics, and stays up after a bad request
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(url.replace("/metrics", "/nope"), timeout=10)
    assert caught.value.code == 404
    assert value(scrape(url), "aiturbo_persist_queue_files") == 0

    text = aiturbo("status", m.mountpoint).stdout
    assert f"metrics {url}" in text and "durable 3" in text, text


def test_default_port_taken_falls_back_to_an_ephemeral_one(make_mount):
    host, port = METRICS_NODE_ADDRESS_DEFAULT.rsplit(":", 1)
    squatter = socket.socket()
    try:
        try:
            squatter.bind((host, int(port)))
            squatter.listen(1)
        except OSError:
            pass  # already taken (another mount on this host): the case under test all the same
        m = make_mount()  # no metrics= option: the default port
        url = status(m)["metrics"]
        assert url and f":{port}/" not in url, url
        assert value(scrape(url), "aiturbo_persist_queue_files") == 0
        assert re.search(rf"metrics_port_taken address={re.escape(METRICS_NODE_ADDRESS_DEFAULT)} fallback=ephemeral",
                         m.log()), m.log()[-3000:]
    finally:
        squatter.close()


def test_explicit_port_taken_fails_the_mount(make_mount):
    squatter = socket.socket()
    try:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        taken = f"127.0.0.1:{squatter.getsockname()[1]}"
        with pytest.raises(RuntimeError) as caught:
            make_mount(metrics=taken)
        assert f"metrics endpoint {taken} is taken" in str(caught.value), str(caught.value)[-3000:]
    finally:
        squatter.close()


def test_metrics_off(make_mount):
    m = make_mount(metrics="off")
    assert status(m)["metrics"] is None
    assert "metrics off" in aiturbo("status", m.mountpoint).stdout
    assert "metrics_serving" not in m.log()


@pytest.fixture
def s3(make_mount):
    """A moto server of this test's own (it is stopped mid-test); after the mounts are gone."""
    server = S3Server()
    try:
        yield server.start()
    finally:
        server.close()


def test_backend_outage_counts_retries_and_the_broken_file(s3, make_mount):
    bucket = s3.make_bucket(f"t-{secrets.token_hex(6)}")
    m = make_mount(f"s3://{bucket}/pre", s3_endpoint=s3.endpoint, metrics="127.0.0.1:0", persist_retry_window="3",
                   s3_connect_timeout="1")
    url = status(m)["metrics"]
    s3.stop()
    try:
        put(m.path("lost.bin"), os.urandom(MiB))
        assert wait_state(m.path("lost.bin"), "broken", DURABLE_WAIT_S) == "broken"
        # The state is recorded before the worker lets go of the file: the
        # queue gauge reaches 0 a moment later (and stays above it if the
        # broken file were requeued).
        s = scrape_until(url, "aiturbo_persist_queue_files", 0, timeout_s=10)
    finally:
        s3.start()  # with its bucket again (moto forgets it): the unmount then talks to a working backend
        s3.make_bucket(bucket)
    assert value(s, "aiturbo_errors_total", kind="backend_retry") >= 1
    assert value(s, "aiturbo_errors_total", kind="broken_file") == 1
    assert value(s, "aiturbo_files_persisted_total", result="broken") == 1
    assert value(s, "aiturbo_errors_total", kind="logged") >= 1
    log = m.log()
    assert re.search(r"persist_retry path=lost\.bin error='.+' retry_in_s=\d", log), log[-3000:]
    assert re.search(r"broken path=lost\.bin reason='backend unavailable for the whole retry window", log), log[-3000:]


# ------------------------------------------------------------------ a cluster


@pytest.fixture
def cluster(pg_server, s3_server, tmp_path):
    c = Cluster(str(tmp_path / "c"), pg=pg_server, s3=s3_server, n=3)
    try:
        yield c.start()
    finally:
        c.close()


def _summaries_of_every_node(c: Cluster) -> list[dict]:
    deadline = time.monotonic() + 30
    while True:
        nodes = c.status(0)["nodes"]
        if sorted(n["node"] for n in nodes if "pool_used" in n and n["state"] == "alive") == ["n0", "n1", "n2"]:
            return nodes
        if time.monotonic() > deadline:
            raise AssertionError(f"not every node's summary arrived: {nodes}")
        time.sleep(0.2)


@pytest.mark.fuse
@pytest.mark.cluster
def test_cluster_status_and_metrics(cluster):
    c = cluster
    job = os.path.join(c.nodes[0].mountpoint, "job")
    os.mkdir(job)
    os.setxattr(job, "user.aiturbo.group", b"j1")
    os.setxattr(job, "user.aiturbo.group.size", b"1")
    data = os.urandom(2 * MiB + 123)
    put(os.path.join(job, "rank0.bin"), data)
    assert wait_state(os.path.join(job, "rank0.bin"), "durable", DURABLE_WAIT_S) == "durable"

    nodes = _summaries_of_every_node(c)
    urls = {n["node"]: n["metrics"] for n in nodes}
    assert all(u and u.startswith("http://") for u in urls.values()), urls
    assert len(set(urls.values())) == 3, urls  # three daemons on one host: three endpoints
    text = aiturbo("status", c.nodes[0].mountpoint, timeout=30).stdout
    table = text[text.index("NODE "):]
    print(f"\n{text}")
    for name, url in urls.items():
        assert re.search(rf"^  {name} +alive .* {re.escape(url)}$", table, re.MULTILINE), text
    # every daemon of the host (other mounts may run too): the cluster's table is shown once
    text = aiturbo("status", timeout=30).stdout
    blocks = re.split(r"\n(?=\S)", text)
    ours = [b for b in blocks if any(b.startswith(m.mountpoint + " ") for m in c.nodes)]
    assert len(ours) == 3 and sum(b.count("NODE ") for b in ours) == 1, text

    s0 = scrape(urls["n0"])
    assert value(s0, "aiturbo_cluster_members", state="alive") == 3
    assert value(s0, "aiturbo_controller_connected") == 1
    assert value(s0, "aiturbo_rounds_total", result="planned") == 1
    assert value(s0, "aiturbo_round_wait_seconds_count") == 1
    assert value(s0, "aiturbo_dedup_bytes_total", kind="logical") == len(data)
    assert value(s0, "aiturbo_dedup_bytes_total", kind="unique") == len(data)
    assert value(s0, "aiturbo_replicated_bytes_total") >= len(data)  # replicas=2: one more node holds it
    sent = sum(v for (name, labels), v in s0.items() if name == "aiturbo_fabric_bytes_total" and
               ("direction", "sent") in labels)
    assert sent >= len(data), sent
    uploaded = sum(value(scrape(u), "aiturbo_backend_bytes_total", direction="uploaded") for u in urls.values())
    assert len(data) <= uploaded < len(data) + MiB

    found = re.search(r"metrics_serving url=(\S+)", c.controller.log())
    assert found, c.controller.log()[-3000:]
    sc = scrape(found.group(1))
    assert value(sc, "aiturbo_controller_nodes", state="alive") == 3
    assert value(sc, "aiturbo_controller_write_rounds_total", result="planned") == 1
    assert value(sc, "aiturbo_controller_write_plan_seconds_count") == 1
    assert value(sc, "aiturbo_controller_write_dedup_bytes_total", kind="logical") == len(data)
    assert re.search(rf"round_planned round=\S+ files=1 bytes={len(data)} unique={len(data)}",
                     c.controller.log()), c.controller.log()[-3000:]
