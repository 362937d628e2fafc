"""bench/run py_train: training from Python, a worker SIGKILLed mid-run.

Case torchrun_restart: `troupe torchrun` vs torchrun, the same script
(examples/torchrun/train_ddp.py, 2 CPU workers, gloo, rank-0 checkpoint
every epoch) under each, run by the same interpreter. Time = from the
SIGKILL of rank 1 to the next completed step of the restarted group
(the step log's timestamps, written by the script); median of --runs.
The peer is torchrun from a PyPI torch in a venv this benchmark creates
(<build>/torch-venv, `pip install torch`, no system site packages):
Debian's own torchrun (torch 1.13, Python 3.11) cannot start a worker
(docs/torchrun.md). When the venv cannot be made, the row says why in
`peer_error` and troupe runs the script with --python-fallback.

Cases trainjob (rows trainjob_recovery_s and trainjob_lost_steps) and
trainer_recovery_s: training from Python, bench/py_train_jobs.py.

Prints one JSON object per line, as every bench/run benchmark does.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "torchrun", "train_ddp.py")
CASES = ["torchrun_restart", "trainjob", "trainer_recovery_s", "all"]


def log(msg):
    print(f"py_train: {msg}", file=sys.stderr, flush=True)


def ensure_venv(venv):
    """The venv's python and torchrun, or (None, reason)."""
    python, torchrun = os.path.join(venv, "bin", "python"), os.path.join(venv, "bin", "torchrun")
    check = [python, "-c", "import torch, torch.distributed.run; print(torch.__version__)"]

    def version():
        r = subprocess.run(check, capture_output=True, text=True, timeout=300)
        return r.stdout.strip() if r.returncode == 0 else None

    if os.path.exists(torchrun) and version():
        return python, torchrun, version(), None
    log(f"creating {venv} and installing torch from PyPI (large: a CUDA build and its libraries)")
    steps = [[sys.executable, "-m", "venv", venv],
             [python, "-m", "pip", "install", "--quiet", "torch", "numpy"]]
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["?"]
            return None, None, None, f"{' '.join(cmd[:4])} failed: {tail[0]}"
    v = version()
    if not v:
        return None, None, None, "torch installed in the venv but does not import"
    return python, torchrun, v, None


def read_steps(path):
    try:
        with open(path) as f:
            rows = [line.split() for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []
    return [(float(t), int(rank), int(step), int(restart)) for t, rank, step, restart in rows]


def wait_until(pred, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.005)
    raise TimeoutError(f"no {what} within {timeout} s")


def stop(proc, pid_dir):
    """Ends the launcher and whatever scripts it left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for name in os.listdir(pid_dir):
        try:
            with open(os.path.join(pid_dir, name)) as f:
                os.kill(int(f.read()), signal.SIGKILL)
        except (ProcessLookupError, ValueError, FileNotFoundError):
            pass


def one_restart(launcher, warm_steps, timeout, kill_after):
    """Seconds from SIGKILL of rank 1 to the restarted group's first step."""
    with tempfile.TemporaryDirectory(prefix="troupe-py-train-") as d:
        steps, pids = os.path.join(d, "steps"), os.path.join(d, "pids")
        os.mkdir(pids)
        args = [SCRIPT, "--epochs", "100000", "--checkpoint", os.path.join(d, "ck.pt"),
                "--step-log", steps, "--pid-dir", pids, "--step-sleep", "0.01"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(os.path.join(d, "out"), "w") as out:
            proc = subprocess.Popen(launcher + args, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True, cwd=d)
        try:
            wait_until(lambda: len([s for s in read_steps(steps) if s[3] == 0]) >= warm_steps, timeout,
                       f"{warm_steps} steps")
            # Mid-run: the job has trained a while.
            first_step = read_steps(steps)[0][0]
            time.sleep(max(0.0, first_step + kill_after - time.time()))
            with open(os.path.join(pids, "rank1.pid")) as f:
                victim = int(f.read())
            t0 = time.time()
            os.kill(victim, signal.SIGKILL)
            first = wait_until(lambda: [s for s in read_steps(steps) if s[3] >= 1], timeout,
                               "step after the restart")
            return min(s[0] for s in first) - t0
        except Exception:
            with open(os.path.join(d, "out")) as f:
                log("launcher output:\n" + f.read()[-3000:])
            raise
        finally:
            stop(proc, pids)


def measure(name, launcher, runs, warm_steps, timeout, kill_after):
    """Seconds of each run that restarted, and why each other one did not
    (a run that never trained again is a failure of that launcher, kept in
    the row, not a reason to stop the benchmark)."""
    values, failures = [], []
    for i in range(runs):
        try:
            v = one_restart(launcher, warm_steps, timeout, kill_after)
        except Exception as e:  # noqa: BLE001 - reported in the row
            log(f"{name} run {i + 1}: FAILED: {e}")
            failures.append(f"run {i + 1}: {e}")
            continue
        log(f"{name} run {i + 1}: {v:.3f} s")
        values.append(v)
    return values, failures


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="all", choices=CASES,
                   help="trainjob prints trainjob_recovery_s and trainjob_lost_steps; all = every case")
    p.add_argument("--build-dir", required=True, help="the build tree (launcher/, python/)")
    p.add_argument("--venv", required=True, help="where the peer's PyPI torch lives (created if absent)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--warm-steps", type=int, default=20)
    p.add_argument("--timeout", type=float, default=180)
    p.add_argument("--kill-after", type=float, default=10,
                   help="seconds from the first step to the SIGKILL (both launchers)")
    p.add_argument("--python-fallback", default="/usr/bin/python3",
                   help="the interpreter for troupe when the venv cannot be made")
    p.add_argument("--no-peer", action="store_true", help="measure troupe torchrun alone")
    p.add_argument("--samples", type=int, default=16384, help="trainjob: training samples")
    p.add_argument("--epochs", type=int, default=2, help="trainjob: epochs")
    p.add_argument("--trainer-steps", type=int, default=300, help="trainer_recovery_s: steps of the loop")
    a = p.parse_args()
    a.build_dir, a.venv = os.path.abspath(a.build_dir), os.path.abspath(a.venv)
    a.troupe = os.path.join(a.build_dir, "launcher", "troupe")
    import py_train_jobs

    failed = False
    # A case that raises prints an error row and the others still run (a
    # traceback ended the run, and --case all skipped the later cases).
    for case, rows in (("trainjob", lambda: py_train_jobs.trainjob_cases(a, log)),
                       ("trainer_recovery_s", lambda: py_train_jobs.trainer_case(a, log))):
        if a.case not in (case, "all"):
            continue
        try:
            for row in rows():
                print(json.dumps(row), flush=True)
        except Exception as e:  # noqa: BLE001 - reported as the case's error row
            log(f"{case}: {type(e).__name__}: {e}")
            print(json.dumps({"bench": "py_train", "case": case, "error": f"{type(e).__name__}: {e}"}), flush=True)
            failed = True
    if a.case in ("torchrun_restart", "all"):
        torchrun_case(a)
    return 1 if failed else 0


def torchrun_case(a):
    python, torchrun, version, why = (None, None, None, "--no-peer") if a.no_peer else ensure_venv(a.venv)
    common = ["--nproc-per-node", str(a.nproc), "--max-restarts", "3"]
    troupe, troupe_failed = measure("troupe torchrun",
                                    [a.troupe, "torchrun", "--python", python or a.python_fallback] + common,
                                    a.runs, a.warm_steps, a.timeout, a.kill_after)
    row = {"bench": "py_train", "case": "torchrun_restart",
           "value": round(statistics.median(troupe), 4) if troupe else None,
           "unit": "s", "runs": [round(v, 4) for v in troupe], "workers": a.nproc,
           "python": python or a.python_fallback, "kill_after_s": a.kill_after}
    if troupe_failed:
        row["failed_runs"] = troupe_failed
    if not troupe:
        row["error"] = "no troupe torchrun run restarted"
    if torchrun:
        peer, peer_failed = measure("torchrun", [torchrun] + common, a.runs, a.warm_steps, a.timeout, a.kill_after)
        row["peer"] = f"torchrun, torch {version} from PyPI (venv)"
        row["peer_runs"] = [round(v, 4) for v in peer]
        if peer_failed:
            row["peer_failed_runs"] = peer_failed
        if peer:
            row["peer_value"] = round(statistics.median(peer), 4)
        if peer and troupe:
            row["ratio"] = round(statistics.median(troupe) / statistics.median(peer), 3)
    else:
        row["peer_error"] = why
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
