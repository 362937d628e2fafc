"""The head's HTTP endpoint for real: a cluster started with `troupe start
--head`, a TrainJob (from Python) with a trainer SIGKILLed mid-run on it;
then /metrics parsed by Prometheus' own text parser (prometheus_client),
/api/status, `troupe status`, and the dashboard page rendered by headless
Chromium: its job chart with the world-size line and the failure marker in
the DOM, and a screenshot (written to $TROUPE_DASHBOARD_SCREENSHOT too when
set: docs/dashboard.png comes from there)."""
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import urllib.error
import urllib.request

import pytest

from conftest import cli, wait_until

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
parser = pytest.importorskip("prometheus_client.parser")

import troupe  # noqa: E402,F401
from troupe.train import TrainJob  # noqa: E402
from step_models import SumRegression  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    launcher = cli()
    session = tmp_path_factory.mktemp("session")
    env = dict(os.environ, TROUPE_SESSION_DIR=str(session))
    env.pop("TROUPE_TOKEN", None)
    # A node that misses heartbeats for 4 s (40 x 100 ms), not 0.5 s, is
    # dead: no node dies here, and a loaded machine (CTest's first minutes)
    # once starved the agent past the default and killed the job's actors.
    out = subprocess.run([launcher, "start", "--head", "--port", "0", "--resources", "CPU=4", "--dashboard-port", "0",
                          "--heartbeat-misses", "40"], env=env, capture_output=True, text=True, timeout=120, check=True)
    url = (session / "dashboard").read_text().strip()
    assert f"dashboard at {url}" in out.stdout, out.stdout
    old = os.environ.get("TROUPE_SESSION_DIR")
    os.environ["TROUPE_SESSION_DIR"] = str(session)
    try:
        yield {"url": url, "env": env, "address": (session / "address").read_text().strip(),
               "token": (session / "token").read_text().strip()}
    finally:
        subprocess.run([launcher, "stop"], env=env, timeout=120)
        if old is None:
            os.environ.pop("TROUPE_SESSION_DIR", None)
        else:
            os.environ["TROUPE_SESSION_DIR"] = old


def get(url, token=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode()


def trainer_pids(url):
    status = json.loads(get(url + "api/status"))
    return [a["pid"] for a in status["actors"]
            if a["class"] == "troupe::trainer::TrainerActor" and a["state"] == "ALIVE"]


@pytest.fixture(scope="module")
def healed_job(cluster, tmp_path_factory):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8192, 16)).astype(np.float32)
    job = TrainJob(SumRegression(), {"x": x, "y": x.sum(1).astype(np.float32)}, workers=2, epochs=12, batch_size=16,
                   max_failures=1, name="dash-job", address=cluster["address"], verbose=False,
                   checkpoint_dir=str(tmp_path_factory.mktemp("ckpt"))).start()
    try:
        wait_until(lambda: len(job.progress()) >= 30 and len(trainer_pids(cluster["url"])) == 2, timeout=120,
                   what="thirty steps on two trainers")
    except AssertionError as e:
        # Say where the job stood: its step lines, its driver's output, the
        # head's view of its actors.
        exited = job._proc.poll()
        steps = len(job.progress())
        output = "".join(job._output)[-3000:]
        status = get(cluster["url"] + "api/status")
        job.stop()
        raise AssertionError(f"{e}: {steps} step lines, driver exit status {exited}; "
                             f"driver output:\n{output}\n/api/status: {status[-3000:]}") from None
    os.kill(trainer_pids(cluster["url"])[1], signal.SIGKILL)
    return job.wait(timeout=300)


def families(text):
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def value(fams, name, **labels):
    for s in fams[name].samples:
        if all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {name}{labels} in {fams[name].samples}")


def test_metrics_parse_with_prometheus_client(cluster, healed_job):
    assert healed_job.recoveries == 1
    fams = families(get(cluster["url"] + "metrics"))
    assert value(fams, "troupe_nodes", state="alive") == 1
    assert value(fams, "troupe_cluster_resource_capacity", resource="CPU") == 4
    assert value(fams, "troupe_job_step", job_name="dash-job") == healed_job.history[-1]["step"]
    assert value(fams, "troupe_job_recoveries", job_name="dash-job") == 1  # the parser drops _total
    assert value(fams, "troupe_job_running", job_name="dash-job") == 0
    assert value(fams, "troupe_job_world_size", job_name="dash-job") == 2
    assert value(fams, "troupe_actors", state="DEAD") >= 3  # two trainers at the end, and the killed one
    assert value(fams, "troupe_head_messages", op="create_actor") >= 3
    # Calls go straight to the workers, which report them: the trainers
    # served hundreds of steps' calls, the loaders streamed batches.
    assert value(fams, "troupe_actor_calls") > 100  # the parser drops _total
    assert value(fams, "troupe_stream_received_bytes") > 0
    # A node's log is read through its agent: the request and the agent's
    # answer both count as read_log (the answer counted as "other").
    before = value(fams, "troupe_head_messages", op="read_log") if any(
        s.labels.get("op") == "read_log" for s in fams["troupe_head_messages"].samples) else 0
    node_log = subprocess.run([cli(), "logs", "node", "1"], env=cluster["env"], capture_output=True, text=True,
                              timeout=60)
    assert node_log.returncode == 0, node_log.stderr
    after = families(get(cluster["url"] + "metrics"))
    assert value(after, "troupe_head_messages", op="read_log") >= before + 2
    assert not [s for s in after["troupe_head_messages"].samples if s.labels.get("op") == "other"]


def test_api_status_and_troupe_status_show_the_job(cluster, healed_job):
    status = json.loads(get(cluster["url"] + "api/status"))
    job = next(j for j in status["jobs"] if j["name"] == "dash-job")
    assert job["state"] == "finished" and job["recoveries"] == 1
    assert "failure" in [e["kind"] for e in job["events"]] and len(job["history"]) > 10
    out = subprocess.run([cli(), "status"], env=cluster["env"], capture_output=True, text=True, timeout=60)
    assert "job dash-job" in out.stdout and "finished" in out.stdout, out.stdout
    # Epochs counted from 1, as the job's console counts them.
    assert job["epoch"] == 11 and job["epochs"] == 12, job
    assert re.search(r"job dash-job .* epoch 12/12 ", out.stdout), out.stdout


def test_loopback_dashboard_needs_no_token_but_refuses_a_wrong_one_politely(cluster):
    assert "troupe_nodes" in get(cluster["url"] + "metrics")
    with pytest.raises(urllib.error.HTTPError) as e:
        get(cluster["url"] + "no-such-page")
    assert e.value.code == 404


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("no chromium on PATH (Debian package chromium)")


def headless(args, timeout=120):
    return subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--virtual-time-budget=4000"] + args, capture_output=True, text=True, timeout=timeout)


def test_dashboard_renders_the_job_chart_in_chromium(cluster, healed_job, tmp_path):
    dom = headless(["--dump-dom", cluster["url"]]).stdout
    # Drawn elements (the page's script holds the same names in templates:
    # match attributes with numbers in them).
    assert re.search(r'<svg[^>]*class="job-chart" id="job-chart-dash-job"', dom), dom[-2000:]
    assert re.search(r'class="world-size"[^>]*points="[0-9]', dom)
    assert re.search(r'class="throughput"[^>]*points="[0-9]', dom)
    assert len(re.findall(r'class="failure-marker" x1="[0-9]', dom)) == 1
    shot = tmp_path / "dashboard.png"
    headless([f"--screenshot={shot}", "--window-size=1200,1000", cluster["url"]])
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == (1200, 1000)
    assert len(data) > 20000  # a page with a table and a chart, not a blank one
    if os.environ.get("TROUPE_DASHBOARD_SCREENSHOT"):
        shutil.copy(shot, os.environ["TROUPE_DASHBOARD_SCREENSHOT"])



def test_job_documents_cannot_script_the_page(cluster, healed_job):
    # Any client of the cluster writes job documents (KV troupe.jobs/...):
    # a field that is not a number must not reach the page as markup. (Last
    # in this file: the document stays until the cluster stops.)
    evil = '<img src=x onerror="document.body.setAttribute(\'data-xss\', 1)">'
    doc = {"name": "evil-job", "state": "running", "step": evil, "epoch": evil, "epochs": evil,
           "world_size": evil, "recoveries": evil, "samples_per_s": evil, "loss": evil,
           "history": [[evil, evil, evil], None, 7], "events": [{"t": evil, "kind": "failure", "detail": evil}, None]}
    troupe.init(address=cluster["address"])
    try:
        troupe._client().kv_put("troupe.jobs/evil-job", json.dumps(doc).encode())
        dom = headless(["--dump-dom", cluster["url"]]).stdout
    finally:
        troupe.shutdown()
    body = dom.split("<script", 1)[0]  # what the page drew, before its own script's text
    assert "evil-job" in body, dom[-2000:]
    assert "data-xss" not in dom.split("</h1>", 1)[0], dom[:2000]
    assert "<img" not in body, body[-3000:]


def test_a_job_document_with_a_long_history_leaves_the_other_charts_drawn(cluster, healed_job):
    # More points than a spread takes as arguments (V8 throws past about
    # 125,000): the chart's maxima threw, and no job's chart was drawn again
    # ("cannot read /api/status: Maximum call stack size exceeded").
    doc = {"name": "long-job", "state": "running", "history": [[1, 1, 1]] * 2 + [1] * 130000}
    troupe.init(address=cluster["address"])
    try:
        troupe._client().kv_put("troupe.jobs/long-job", json.dumps(doc, separators=(",", ":")).encode())
        dom = headless(["--dump-dom", cluster["url"]]).stdout
    finally:
        troupe._client().kv_erase("troupe.jobs/long-job")
        troupe.shutdown()
    assert re.search(r'<svg[^>]*class="job-chart" id="job-chart-dash-job"', dom), dom[-2000:]
    assert re.search(r'<svg[^>]*class="job-chart" id="job-chart-long-job"', dom), dom[-2000:]
    assert '<div id="error"></div>' in dom, dom[:3000]
