"""The package's `troupe` console script (troupe._cli): it execs the C++ CLI,
and `troupe torchrun` runs the script with the package's interpreter unless
--python names another."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import cli, session_env

from troupe import _cli


def run_cli(args, tmp_path, timeout=180):
    env = dict(os.environ, TROUPE_CLI=cli(), TROUPE_SESSION_DIR=str(tmp_path / "session"))
    env.pop("TROUPE_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "troupe._cli"] + args, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_the_commands(tmp_path):
    out = run_cli(["--help"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "torchrun" in out.stdout and "start" in out.stdout


def test_the_package_cli_and_pyproject_say_one_version(tmp_path):
    import pathlib
    import re

    import troupe

    out = run_cli(["--version"], tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == f"troupe {troupe.__version__}", out.stdout + out.stderr
    pyproject = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == troupe.__version__


def test_a_mistyped_command_and_a_bad_address_are_named(tmp_path):
    out = run_cli(["stauts"], tmp_path)
    assert out.returncode == 2 and "unknown command 'stauts' (commands: start, status" in out.stderr, out.stderr
    # With --help too (it printed the usage and exited 0).
    out = run_cli(["stauts", "--help"], tmp_path)
    assert out.returncode == 2 and "unknown command 'stauts'" in out.stderr, out.stdout + out.stderr
    out = run_cli([], tmp_path)
    assert out.returncode == 2 and "Usage:" in out.stderr, out.stderr
    # Checked before the driver runs (it used to start, and fail later).
    out = run_cli(["submit", "--address", "garbage", "--", "/bin/true"], tmp_path)
    assert out.returncode == 2 and "'garbage' is not HOST:PORT" in out.stderr, out.stderr
    # A misspelt submit option is named (it read "argument not expected: /bin/true").
    for args in (["submit", "--adress", "auto", "--", "/bin/true"], ["submit", "--adress=auto", "--", "/bin/true"]):
        out = run_cli(args, tmp_path)
        assert out.returncode == 2 and "unknown option --adress" in out.stderr, out.stderr
    out = run_cli(["submit", "--runtime-env-json", "{", "--", "/bin/true"], tmp_path)
    assert out.returncode == 2 and "unknown option" not in out.stderr, out.stderr  # its own error, about the JSON


def test_torchrun_uses_this_interpreter(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os, sys\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], "
                      "'python', sys.executable, flush=True)\n")
    out = run_cli(["torchrun", "--nproc-per-node", "2", str(script)], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout + out.stderr
    for rank in (0, 1):
        assert f"rank {rank} of 2 python {sys.executable}" in text, text


def test_a_later_python_flag_wins():
    argv = _cli.command_line("/bin/troupe", ["torchrun", "--python", "/opt/py", "s.py", "--python", "x"])
    assert argv[:4] == ["/bin/troupe", "torchrun", "--python", sys.executable]
    assert argv[4:] == ["--python", "/opt/py", "s.py", "--python", "x"]
    assert _cli.command_line("/bin/troupe", ["status"]) == ["/bin/troupe", "status"]


def test_missing_binary_is_named(tmp_path):
    env = dict(os.environ, TROUPE_CLI=str(tmp_path / "no-such-troupe"))
    out = subprocess.run([sys.executable, "-m", "troupe._cli", "status"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "no-such-troupe" in out.stderr


def test_torchrun_of_a_directory_says_it_is_one(tmp_path):
    # A directory given as the script used to be reported as "no such file".
    folder = tmp_path / "project"
    folder.mkdir()
    out = run_cli(["torchrun", "--nproc-per-node", "1", str(folder)], tmp_path, timeout=60)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert str(folder) in lines[0] and "is a directory" in lines[0] and "script file" in lines[0], lines[0]
    assert "no such file" not in lines[0]
    # A missing script is still named as missing.
    out = run_cli(["torchrun", str(tmp_path / "missing.py")], tmp_path, timeout=60)
    assert out.returncode != 0 and "missing.py: no such file" in out.stderr


def test_submit_gives_a_python_driver_the_jobs_runtime_env(tmp_path):
    """`troupe submit --runtime-env-json` runs the driver against the
    session's cluster with that runtime_env as the job's (a relative
    working_dir is the submitter's), under what troupe.init gives; a value
    that is no JSON object is one line and exit code 2 before anything
    starts."""
    launcher = cli()
    session, env = session_env(tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    (project / "submitted_helper.py").write_text("def greet():\n    return 'hello from the working_dir'\n")
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent("""
        import os
        import troupe

        troupe.init(runtime_env={"env_vars": {"OWN": "init"}})

        @troupe.remote
        def greet():
            import submitted_helper
            return submitted_helper.greet(), os.environ.get("FROM_SUBMIT"), os.environ.get("OWN")

        print(troupe.get(greet.remote(), timeout=60), flush=True)
        troupe.shutdown()
    """))
    bad = subprocess.run([launcher, "submit", "--runtime-env-json", "[1]", "--", sys.executable, str(driver)],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "'[1]' is not a JSON object" in bad.stderr, bad.stderr
    # A misspelt key, or a working_dir that is not there, before the driver starts (it was the driver's first
    # error, after the cluster was found).
    for given, said in (({"working_dirs": "."}, 'key "working_dirs" is not one troupe takes'),
                        ({"working_dir": "no_such_folder"}, 'working_dir "no_such_folder" is not a directory here')):
        bad = subprocess.run([launcher, "submit", "--runtime-env-json", json.dumps(given), "--", sys.executable,
                              str(driver)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and said in bad.stderr, bad.stdout + bad.stderr
    subprocess.run([launcher, "start", "--head", "--port", "0", "--resources", "CPU=2"], env=env, check=True,
                   timeout=120)
    try:
        runtime_env = {"working_dir": "project", "env_vars": {"FROM_SUBMIT": "yes", "OWN": "submit"}}
        run = subprocess.run([launcher, "submit", "--runtime-env-json", json.dumps(runtime_env), "--",
                              sys.executable, str(driver)], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=180)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "('hello from the working_dir', 'yes', 'init')" in run.stdout, run.stdout + run.stderr
    finally:
        subprocess.run([launcher, "stop"], env=env, timeout=120)


@contextlib.contextmanager
def agent_that_cannot_see(tmp_path, hidden, agent_session=None):
    """A cluster of one head (no CPUs) and one node agent in a mount
    namespace with a tmpfs over `hidden` (another host's view: the
    driver's files there are not its); yields the session's environment.
    With `agent_session`, the agent keeps its own session directory there,
    as on another host."""
    import shutil

    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a mount namespace needs root and unshare")
    launcher = cli()
    session, env = session_env(tmp_path)
    subprocess.run([launcher, "start", "--head", "--port", "0", "--resources", "CPU=0"], env=env, check=True,
                   timeout=120)
    agent = None
    try:
        address = (session / "address").read_text().strip()
        agent_env = env
        if agent_session is not None:
            agent_session.mkdir(mode=0o700)
            agent_env = dict(env, TROUPE_SESSION_DIR=str(agent_session),
                             TROUPE_TOKEN=(session / "token").read_text().strip())
        agent = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c",
             'mount -t tmpfs tmpfs "$1" && exec "$2" start --address "$3" --resources CPU=2 --block',
             "sh", str(hidden), launcher, address], env=agent_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        yield env
    finally:
        subprocess.run([launcher, "stop"], env=env, timeout=120)
        if agent is not None:
            try:
                agent.wait(timeout=60)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()


_WAIT_FOR_TWO_NODES = """
import os, sys, time
import troupe

troupe.init(address="auto")
deadline = time.monotonic() + 120
while sum(1 for n in troupe.nodes() if n["Alive"]) < 2:
    assert time.monotonic() < deadline, "the namespaced agent never joined"
    time.sleep(0.2)
"""


def test_python_actors_run_on_a_node_that_cannot_see_the_drivers_files(tmp_path):
    """A node agent whose temp directory is not the driver's (another host,
    or a Slurm node with its own /tmp) runs the driver's Python actors: the
    worker launcher travels as text and the agent writes it itself. It was
    written to the driver's TMPDIR, and every worker on such a node failed
    with "cannot run .../troupe-python-0/worker-...: No such file"."""
    driver_tmp = tmp_path / "driver_tmp"
    driver_tmp.mkdir()
    with agent_that_cannot_see(tmp_path, driver_tmp) as env:
        driver = tmp_path / "driver.py"
        driver.write_text(_WAIT_FOR_TWO_NODES + textwrap.dedent("""
            @troupe.remote(num_cpus=1)
            class Where:
                def files(self, path):
                    return sorted(os.listdir(path)), os.getpid()

            where = Where.remote()
            print("seen by the worker:", troupe.get(where.files.remote(sys.argv[1]), timeout=120), flush=True)
            troupe.shutdown()
        """))
        run = subprocess.run([sys.executable, str(driver), str(driver_tmp)], env=dict(env, TMPDIR=str(driver_tmp)),
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        # The worker's view of the driver's TMPDIR is the namespace's
        # empty tmpfs: what the driver wrote there it cannot see.
        assert "seen by the worker: ([]," in run.stdout, run.stdout + run.stderr


def test_the_model_and_data_are_shipped_to_a_node_that_cannot_see_them(tmp_path):
    """A TrainJob given its model and data as objects saves them in the
    driver's temp folder, and `troupe train --model/--data` names the
    driver's files: a trainer on another host could not read either (a
    TrainJob could not train on a cluster whose hosts share no temp
    folder). The driver now ships them: TrainJob does so by itself on a
    cluster, `troupe train` with --ship-files, and without it says so."""
    pytest.importorskip("torch")
    driver_tmp = tmp_path / "driver_tmp"
    driver_tmp.mkdir()
    session = tmp_path / "agent-session"  # the trainers' host's
    with agent_that_cannot_see(tmp_path, driver_tmp, agent_session=session) as env:
        driver = tmp_path / "driver.py"
        driver.write_text(_WAIT_FOR_TWO_NODES + textwrap.dedent("""
            from typing import Dict
            import numpy as np
            import torch
            from troupe.train import TrainJob

            class Step(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.net = torch.nn.Linear(8, 1)

                def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
                    err = self.net(batch["features"]).squeeze(1) - batch["value"]
                    return {"loss": (err * err).mean()}

            rng = np.random.default_rng(0)
            x = rng.standard_normal((256, 8)).astype(np.float32)
            data = {"features": x, "value": x.sum(1).astype(np.float32)}
            torch.manual_seed(0)
            step = Step()
            result = TrainJob(step, data, address="auto", workers=1, epochs=2, batch_size=32, lr=0.05,
                              checkpoint_dir=sys.argv[2], verbose=False).fit()
            print("trainjob losses:", [round(e["train_loss"], 4) for e in result.epochs], flush=True)
            # The same, as files in the driver's temp folder, for troupe train.
            torch.jit.save(torch.jit.script(step), os.path.join(sys.argv[1], "step.pt"))
            np.savez(os.path.join(sys.argv[1], "data.npz"), **data)
        """))
        run = subprocess.run([sys.executable, str(driver), str(driver_tmp), str(tmp_path / "job")],
                             env=dict(env, TMPDIR=str(driver_tmp)), capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        losses = re.search(r"trainjob losses: \[(.*)\]", run.stdout)
        assert losses, run.stdout + run.stderr
        first, last = (float(v) for v in losses.group(1).split(", "))
        assert last < first, run.stdout

        train = [cli(), "train", "--model", str(driver_tmp / "step.pt"), "--data", str(driver_tmp / "data.npz"),
                 "--address", "auto", "--workers", "1", "--epochs", "1", "--batch-size", "32"]
        refused = subprocess.run(train + ["--checkpoint-dir", str(tmp_path / "refused")], env=env,
                                 capture_output=True, text=True, timeout=300)
        assert refused.returncode != 0, refused.stdout + refused.stderr
        said = refused.stdout + refused.stderr
        assert f"the model {driver_tmp / 'step.pt'} is not on" in said, said
        assert "--ship-files" in said, said
        shipped = subprocess.run(train + ["--checkpoint-dir", str(tmp_path / "shipped"), "--ship-files"], env=env,
                                 capture_output=True, text=True, timeout=300)
        assert shipped.returncode == 0, shipped.stdout + shipped.stderr
        assert "epoch 1/1" in shipped.stdout, shipped.stdout
        # One copy of each on the trainers' host, in its session directory.
        copies = [p.name.split("-", 1)[1] for p in (session / "shipped").iterdir() if p.suffix not in (".lock", ".use")]
        assert set(copies) == {"data.npz", "step.pt", "data.npz.ok", "step.pt.ok"}, copies  # each with its record
    # They go with the node agent, stopped by `troupe stop` of the head's
    # session (nobody runs troupe stop on every host).
    assert not (session / "shipped").exists()


def test_an_agent_leaves_the_shipped_copies_while_its_session_runs_more(tmp_path):
    """A node agent removes its session's shipped/ when it stops, but not
    while another process of the session (its head, another agent) runs:
    their workers may be reading or fetching copies there. `troupe stop`
    removes them once nothing runs."""
    launcher = cli()
    session, env = session_env(tmp_path)
    subprocess.run([launcher, "start", "--head", "--port", "0", "--resources", "CPU=1"], env=env, check=True,
                   timeout=120)
    try:
        address = (session / "address").read_text().strip()
        subprocess.run([launcher, "start", "--address", address, "--resources", "CPU=1"], env=env, check=True,
                       timeout=120)
        (session / "shipped").mkdir(mode=0o700)
        (session / "shipped" / "0123456789abcdef-data.npz").write_bytes(b"a copy")
        second = next(p for p in session.glob("node-2-*.pid"))
        pid = int(second.name.rsplit("-", 1)[1].split(".")[0])
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z":
            assert time.monotonic() < deadline, "the second agent did not stop"
            time.sleep(0.05)
        assert (session / "shipped" / "0123456789abcdef-data.npz").exists()  # the head's node still runs
    finally:
        subprocess.run([launcher, "stop"], env=env, timeout=120)
    assert not (session / "shipped").exists()


def test_a_torchrun_rank_on_a_node_without_the_drivers_folder_runs_in_the_scripts_and_says_so(tmp_path):
    """The driver's working directory is not on the rank's node: the rank
    runs in the script's folder, and the driver's console says so (it was
    said in the worker's log only)."""
    hidden = tmp_path / "hidden"  # empty on the agent's node: driver_cwd is not there
    driver_cwd = hidden / "driver_cwd"
    driver_cwd.mkdir(parents=True)
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "where.py").write_text("import os\nprint('cwd', os.getcwd(), flush=True)\n")
    with agent_that_cannot_see(tmp_path, hidden) as env:
        joined = subprocess.run([sys.executable, "-c", _WAIT_FOR_TWO_NODES], env=env, capture_output=True, text=True,
                                timeout=300)
        assert joined.returncode == 0, joined.stdout + joined.stderr
        run = subprocess.run([cli(), "torchrun", "--address", "auto", "--nproc-per-node", "1", "--python",
                              sys.executable, str(scripts / "where.py")], cwd=driver_cwd, env=env,
                             capture_output=True, text=True, timeout=300)
    said = run.stdout + run.stderr
    assert run.returncode == 0, said
    assert f"cwd {scripts}" in said, said
    assert f"the driver's working directory {driver_cwd} is not on " in said, said
    assert f"rank 0 runs in {scripts}" in said, said


def test_torchrun_ships_its_working_dir_to_a_node_that_cannot_see_it(tmp_path):
    """--ship-working-dir: the driver's folder (the script, a module beside
    it, a data file read by a relative path) reaches a node that does not
    have it, and each rank runs in that node's copy; what .gitignore names
    stays behind. Without the flag the rank is refused, naming it; a script
    outside the folder, or one the packing leaves out, is refused before
    anything runs. A second run gets a fresh copy (a probe's second run
    resumed from the checkpoint the first left in the copy), also when
    started from a symlink to the folder with the script's path through
    it (refused as outside the folder before)."""
    hidden = tmp_path / "hidden"  # empty on the agent's node
    project = hidden / "project"
    (project / "outputs").mkdir(parents=True)
    (project / "outputs" / "big.pt").write_text("stays on the driver's machine")
    (project / ".gitignore").write_text("outputs/\nscratch.py\n")
    (project / "scratch.py").write_text("print('never shipped')\n")
    (project / "helper.py").write_text("GREETING = 'hello from the shipped folder'\n")
    (project / "data.txt").write_text("read by a relative path")
    (project / "train.py").write_text(textwrap.dedent("""
        import os
        import helper
        rank = os.environ["RANK"]
        print("rank", rank, helper.GREETING, open("data.txt").read(), flush=True)
        print("rank", rank, "outputs shipped:", os.path.exists("outputs"), flush=True)
        print("rank", rank, "cwd", os.getcwd(), flush=True)
        print("rank", rank, "left by an earlier run:", os.path.exists(f"written_{rank}.txt"), flush=True)
        open(f"written_{rank}.txt", "w").write(rank)
    """))
    link = tmp_path / "link"
    link.symlink_to(project)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    torchrun = [cli(), "torchrun", "--address", "auto", "--nproc-per-node", "2", "--python", sys.executable]
    with agent_that_cannot_see(tmp_path, hidden) as env:
        joined = subprocess.run([sys.executable, "-c", _WAIT_FOR_TWO_NODES], env=env, capture_output=True, text=True,
                                timeout=300)
        assert joined.returncode == 0, joined.stdout + joined.stderr
        refused = subprocess.run(torchrun + ["train.py"], cwd=project, env=env, capture_output=True, text=True,
                                 timeout=300)
        # Given as ../project/train.py: named without the "..".
        outside = subprocess.run(torchrun + ["--ship-working-dir", os.path.relpath(project / "train.py", elsewhere)],
                                 cwd=elsewhere,
                                 env=env, capture_output=True, text=True, timeout=300)
        excluded = subprocess.run(torchrun + ["--ship-working-dir", "scratch.py"], cwd=project, env=env,
                                  capture_output=True, text=True, timeout=300)
        run = subprocess.run(torchrun + ["--ship-working-dir", "train.py"], cwd=project, env=env,
                             capture_output=True, text=True, timeout=300)
        again = subprocess.run(torchrun + ["--ship-working-dir", str(link / "train.py")], cwd=link, env=env,
                               capture_output=True, text=True, timeout=300)
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "is not on this node" in said and "--ship-working-dir" in said, said
    said = outside.stdout + outside.stderr
    assert outside.returncode == 1, said
    assert (f"ships the working directory {elsewhere}, which does not hold the script {project.resolve()}/train.py: "
            "run troupe torchrun from a folder that holds it") in said, said
    said = excluded.stdout + excluded.stderr
    assert excluded.returncode == 1 and "leaves the script scratch.py out of what it ships" in said, said
    said = run.stdout + run.stderr
    assert run.returncode == 0, said
    assert f"shipping {project} (4 files" in said, said  # .gitignore, data.txt, helper.py, train.py
    for rank in ("0", "1"):
        assert f"rank {rank} hello from the shipped folder read by a relative path" in said, said
        assert f"rank {rank} outputs shipped: False" in said, said
    cwds = set(re.findall(r"rank \d cwd (\S+)", said))
    assert len(cwds) == 1, said  # one copy for the node's ranks
    assert "/shipped/" in next(iter(cwds)) and str(project) not in next(iter(cwds)), said
    said = again.stdout + again.stderr
    assert again.returncode == 0, said
    for rank in ("0", "1"):
        assert f"rank {rank} left by an earlier run: False" in said, said
    assert set(re.findall(r"rank \d cwd (\S+)", said)).isdisjoint(cwds), said


def test_a_torch_trainers_rank_0_that_cannot_see_the_run_folder_fails_the_run_at_once(tmp_path):
    """Rank 0 on a node that does not see RunConfig(storage_path=...) wrote
    the run's checkpoints and progress to its own disk, and fit() returned
    a result without them (metrics {}, checkpoint None, no error)."""
    pytest.importorskip("torch")
    storage = tmp_path / "results"
    storage.mkdir()
    with agent_that_cannot_see(tmp_path, storage) as env:
        driver = tmp_path / "driver.py"
        driver.write_text(_WAIT_FOR_TWO_NODES + textwrap.dedent("""
            import tempfile
            from troupe import train
            from troupe.train.torch import TorchTrainer

            def loop():
                with tempfile.TemporaryDirectory() as d:
                    open(os.path.join(d, "w.txt"), "w").write("x")
                    train.report({"loss": 1.0}, checkpoint=train.Checkpoint.from_directory(d))

            trainer = TorchTrainer(loop, scaling_config=train.ScalingConfig(num_workers=2),
                                   run_config=train.RunConfig(storage_path=sys.argv[1], name="run",
                                                              failure_config=train.FailureConfig(max_failures=-1)))
            try:
                trainer.fit()
                print("fit returned", flush=True)
            except train.TrainingFailedError as e:
                print("failed:", e, "failures:", trainer.failures, flush=True)
        """))
        run = subprocess.run([sys.executable, str(driver), str(storage)], env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "does not see the run folder" in run.stdout and "a folder every node shares" in run.stdout, run.stdout
        assert "failures: 0" in run.stdout, run.stdout  # not retried: every attempt would meet it
        assert not list((storage / "run").glob(".validate_storage_marker*"))


def test_no_token_file_keeps_the_token_in_the_environment_only(tmp_path):
    """`troupe start --no-token-file` (troupe slurm's head and agents) writes
    no token into the session directory; it needs TROUPE_TOKEN."""
    launcher = cli()
    session, env = session_env(tmp_path)
    refused = subprocess.run([launcher, "start", "--head", "--port", "0", "--no-token-file"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--no-token-file needs the token in TROUPE_TOKEN" in refused.stderr, refused
    env["TROUPE_TOKEN"] = "a" * 32
    started = subprocess.run([launcher, "start", "--head", "--port", "0", "--resources", "CPU=1", "--no-token-file"],
                             env=env, capture_output=True, text=True, timeout=120)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert "token in TROUPE_TOKEN only" in started.stdout, started.stdout
        assert not (session / "token").exists()
        status = subprocess.run([launcher, "status"], env=env, capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
    finally:
        subprocess.run([launcher, "stop"], env=env, timeout=120)
