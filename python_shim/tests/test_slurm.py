"""`troupe slurm` against a real Slurm: the test starts slurmctld and two
slurmd (Debian's slurm-wlm; two node names on this host, auth/none since
nothing leaves the machine) from a configuration in a temporary directory,
and stops them in every path. A two-node sbatch job runs a Python driver
whose actors land on both nodes; in a job whose nodes have different CPU
counts (-n3 on two nodes) each agent offers its own node's; a job cancelled
with scancel mid-run leaves no troupe process behind; outside an
allocation, and with GPUs asked for where there are none, the command
refuses with the variables it read.
Skipped where slurmctld is missing or the test is not root."""
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

from conftest import cli, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("slurmctld"),
                                reason="needs root and Debian's slurmctld/slurmd (slurm-wlm)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONF = """ClusterName=troupetest
SlurmctldHost=localhost
SlurmctldPort={ctld}
SlurmdPort={slurmd}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
KillWait=5
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1} CPUs=2 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n2} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    conf = d / "slurm.conf"
    conf.write_text(CONF.format(d=d, ctld=free_port(), slurmd=free_port(), n1=free_port(), n2=free_port()))
    env = dict(os.environ, SLURM_CONF=str(conf), PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    global _CONF_VAR
    _CONF_VAR = f"SLURM_CONF={conf}".encode()
    daemons = []
    try:
        daemons.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(conf)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for node in ("n1", "n2"):
            daemons.append(subprocess.Popen(["slurmd", "-D", "-f", str(conf), "-N", node], env=env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def idle():
            out = subprocess.run(["sinfo", "-h", "-o", "%T %D"], env=env, capture_output=True, text=True, timeout=30)
            return out.stdout.split() == ["idle", "2"]
        wait_until(idle, timeout=60, what="two idle Slurm nodes")
        yield {"env": env, "dir": d}
    finally:
        for p in daemons:
            p.terminate()
        for p in daemons:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


_CONF_VAR = None  # b"SLURM_CONF=...": what this file's jobs have in their environment


def troupe_processes():
    """Pids of processes of this file's Slurm jobs running the troupe
    binary (its workers included): not those of another troupe cluster or
    Slurm on the machine, which a test run beside this one may have."""
    binary = os.path.realpath(cli())
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.path.realpath(f"/proc/{pid}/exe") != binary:
                    continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if _CONF_VAR is not None and _CONF_VAR in f.read().split(b"\0"):
                        pids.append(int(pid))
            except OSError:
                pass
    return pids


DRIVER = """
import troupe
troupe.init(address="auto")
@troupe.remote(num_cpus=2)
class Where:
    def node(self):
        return troupe.get_runtime_context().get_node_id()
actors = [Where.remote() for _ in range(2)]
print("nodes:", sorted(troupe.get([a.node.remote() for a in actors], timeout=120)), flush=True)
"""


def test_two_node_job_runs_its_driver_on_both_nodes(slurm, tmp_path):
    (tmp_path / "driver.py").write_text(DRIVER)
    out = tmp_path / "job.out"
    # The job's session directory (its token, state db) goes with the job.
    job_tmp = tmp_path / "tmp"
    job_tmp.mkdir()
    r = subprocess.run(["sbatch", "--wait", "-N2", "--exclusive", f"--output={out}", "--wrap",
                        f"{cli()} slurm --port 0 -- /usr/bin/python3 {tmp_path / 'driver.py'}"],
                       env={**slurm["env"], "TMPDIR": str(job_tmp)}, capture_output=True, text=True, timeout=300)
    text = out.read_text()
    assert r.returncode == 0, r.stderr + text
    assert "troupe slurm: cluster of 2 node(s)" in text, text
    assert "nodes: ['1', '2']" in text, text
    assert "troupe slurm: driver exited with 0; cluster stopped" in text, text
    # The agents stop when the head tells them, and srun's step ends by
    # itself: a SIGTERM to srun made it SIGKILL every agent, and every
    # clean job's output said so.
    assert "forcing job termination" not in text and "CANCELLED" not in text and "Killed" not in text, text
    wait_until(lambda: not troupe_processes(), timeout=30, what="no troupe process left")
    assert not list(job_tmp.glob("troupe-slurm-*")), list(job_tmp.iterdir())


def test_a_failed_job_keeps_its_logs_but_not_its_token(slurm, tmp_path):
    out = tmp_path / "job.out"
    job_tmp = tmp_path / "tmp"
    job_tmp.mkdir()
    r = subprocess.run(["sbatch", "--wait", "-N2", f"--output={out}", "--wrap",
                        f"{cli()} slurm --port 0 -- /bin/sh -c 'exit 3'"],
                       env={**slurm["env"], "TMPDIR": str(job_tmp)}, capture_output=True, text=True, timeout=300)
    text = out.read_text()
    assert r.returncode != 0 and "driver exited with 3" in text, r.stderr + text
    kept = list(job_tmp.glob("troupe-slurm-*"))
    assert len(kept) == 1 and f"kept the session directory {kept[0]}" in text, text
    assert (kept[0] / "head.log").exists(), list(kept[0].iterdir())
    # The other node's agent logs are kept too (its directory went with
    # every job, the failed ones included).
    assert list((kept[0] / "node-1").glob("node-*.log")), list(kept[0].rglob("*"))
    # Each agent was stopped by its script, not killed by the SIGUSR1 srun
    # sends to the whole task.
    assert "Exited with exit code" not in text and "forcing job termination" not in text, text
    assert "killed by signal" not in text, text
    assert not list(kept[0].rglob("token")), "the cluster's token outlived it"
    wait_until(lambda: not troupe_processes(), timeout=30, what="no troupe process left")


CPUS_DRIVER = """
import troupe
troupe.init(address="auto")
print("cpus:", sorted(n["Resources"]["CPU"] for n in troupe.nodes() if n["Alive"]), flush=True)
"""


def test_nodes_of_different_sizes_each_offer_their_own_cpus(slurm, tmp_path):
    # Three tasks on two 2-CPU nodes: SLURM_JOB_CPUS_PER_NODE=2,1. The agents'
    # step used to ask every node for the first node's 2 CPUs, which Slurm
    # refused ("More processors requested than permitted").
    (tmp_path / "driver.py").write_text(CPUS_DRIVER)
    out = tmp_path / "job.out"
    r = subprocess.run(["sbatch", "--wait", "-N2", "-n3", f"--output={out}", "--wrap",
                        f"{cli()} slurm --port 0 -- /usr/bin/python3 {tmp_path / 'driver.py'}"],
                       env=slurm["env"], capture_output=True, text=True, timeout=300)
    text = out.read_text()
    assert r.returncode == 0, r.stderr + text
    assert "troupe slurm: cluster of 2 node(s)" in text and "CPU=2,1 by node" in text, text
    assert "cpus: [1.0, 2.0]" in text, text
    wait_until(lambda: not troupe_processes(), timeout=30, what="no troupe process left")


def test_scancel_ends_everything(slurm, tmp_path):
    ready = tmp_path / "ready"
    job_tmp = tmp_path / "tmp"
    job_tmp.mkdir()
    job = subprocess.run(["sbatch", "--parsable", "-N2", "--exclusive", f"--output={tmp_path / 'job.out'}", "--wrap",
                          f"{cli()} slurm --port 0 -- /bin/sh -c 'touch {ready}; sleep 600'"],
                         env={**slurm["env"], "TMPDIR": str(job_tmp)}, capture_output=True, text=True, timeout=60,
                         check=True).stdout.strip()
    wait_until(ready.exists, timeout=120, what="the driver running")
    assert len(troupe_processes()) >= 3  # the head, its node agents, troupe slurm
    subprocess.run(["scancel", job], env=slurm["env"], check=True, timeout=60)
    t0 = time.monotonic()
    wait_until(lambda: not troupe_processes(), timeout=30, what="no troupe process after scancel")
    print(f"every troupe process gone {time.monotonic() - t0:.2f} s after scancel")
    # The cluster's secret is on no disk: a scancel SIGKILLs troupe slurm
    # (nothing of it cleans up), and the session it left held the token.
    assert list(job_tmp.glob("troupe-slurm-*/head.log")), list(job_tmp.rglob("*"))
    assert not list(job_tmp.rglob("token")), list(job_tmp.rglob("*"))


# DRIVER, which first waits (bounded) for a SIGUSR1 and says whether it came.
WARNED_DRIVER = """
import signal
import sys
import time

got = []
signal.signal(signal.SIGUSR1, lambda sig, frame: got.append(sig))
""" + DRIVER.replace("actors = [", """open(sys.argv[1], "w").close()
deadline = time.monotonic() + 120
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
print("usr1:", len(got), flush=True)
actors = [""", 1)


def _troupe_slurm_pid():
    """The pid of this file's running `troupe slurm` (the batch shell's
    command: what --signal=B:USR1@T signals)."""
    for pid in troupe_processes():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[1:2] == [b"slurm"]:
                    return pid
        except OSError:
            pass
    return None


def test_a_time_limit_warning_reaches_the_driver_and_spares_the_cluster(slurm, tmp_path):
    # --signal=USR1@90 signals the job's steps: each agent's script took it
    # for troupe slurm's "keep the logs" and stopped its agent. With B: it
    # signals the batch shell: troupe slurm died of it, and its driver with
    # it. Now the steps ignore it and troupe slurm passes it on.
    (tmp_path / "driver.py").write_text(WARNED_DRIVER)
    ready = tmp_path / "ready"
    out = tmp_path / "job.out"
    job = subprocess.run(["sbatch", "--parsable", "-N2", "--exclusive", f"--output={out}", "--wrap",
                          f"{cli()} slurm --port 0 -- /usr/bin/python3 {tmp_path / 'driver.py'} {ready}"],
                         env=slurm["env"], capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    wait_until(ready.exists, timeout=120, what="the driver running")
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm["env"], check=True, timeout=60)
    pid = _troupe_slurm_pid()
    assert pid is not None, troupe_processes()
    os.kill(pid, signal.SIGUSR1)
    wait_until(lambda: "driver exited" in out.read_text() or not troupe_processes(), timeout=240,
               what="the job's end")
    text = out.read_text()
    assert "troupe slurm: SIGUSR1: passed on to the driver" in text, text
    assert "usr1: 1" in text, text
    assert "nodes: ['1', '2']" in text, text  # both agents still served
    assert "driver exited with 0" in text, text
    wait_until(lambda: not troupe_processes(), timeout=30, what="no troupe process left")


def test_two_jobs_sharing_nodes_each_get_a_head_port(slurm, tmp_path):
    # Without --port: both used to want 6380 and the second job's head
    # failed ("bind 127.0.0.1:6380: Address already in use").
    outs = [tmp_path / f"job{i}.out" for i in range(2)]
    # Each driver waits for the other's: both heads are up at once.
    both = tmp_path / "both.sh"
    both.write_text(f"#!/bin/sh\ntouch {tmp_path}/up-$SLURM_JOB_ID\nn=0\n"
                    f"while [ $(ls {tmp_path} | grep -c '^up-') -lt 2 ] && [ $n -lt 600 ]; do sleep 0.2; n=$((n+1)); "
                    "done\n[ $n -lt 600 ]\n")
    both.chmod(0o755)
    jobs = [subprocess.Popen(["sbatch", "--wait", "-N2", "-n2", f"--output={out}", "--wrap",
                              f"{cli()} slurm -- {both}"], env=slurm["env"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for out in outs]
    for job, out in zip(jobs, outs):
        _, err = job.communicate(timeout=300)
        assert job.returncode == 0, err + out.read_text()
        assert "driver exited with 0" in out.read_text(), out.read_text()
    wait_until(lambda: not troupe_processes(), timeout=30, what="no troupe process left")


def test_bad_input_is_refused_with_what_was_read(slurm, tmp_path):
    outside = subprocess.run([cli(), "slurm", "--", "true"], env={k: v for k, v in os.environ.items()
                                                                   if not k.startswith("SLURM_")},
                             capture_output=True, text=True, timeout=60)
    assert outside.returncode == 2 and "SLURM_JOB_ID is not set" in outside.stderr
    out = tmp_path / "gpus.out"
    r = subprocess.run(["sbatch", "--wait", "-N1", f"--output={out}", "--wrap",
                        f"{cli()} slurm --gpus-per-node 2 -- true"], env=slurm["env"], capture_output=True, text=True,
                       timeout=120)
    text = out.read_text()
    assert r.returncode != 0
    assert "--gpus-per-node 2 but the allocation has 0 GPU(s)" in text and "SLURM_GPUS_ON_NODE" in text, text
    assert "CUDA_VISIBLE_DEVICES" in text
