"""bench/run py_ship: what shipping a data set costs the driver.

A cluster of one head (no CPUs) and --hosts node agents, each in a mount
namespace with a tmpfs over the folder that holds the data set (another
host's view: the driver's file is not there) and a session directory of its
own. `troupe train --ship-files` trains an MLP for a few steps on an .npz of
--mb MiB that the hosts fetch from the driver; the peer is the same job
without shipping on a path the hosts see (a hard link to the same file),
measured in the same run. Cases (peak resident memory of the driver's
process, from wait4's rusage; wall seconds):

  ship_driver_rss_mb      shipped, every host fetching (no copy there yet)
  ship_cached_rss_mb      shipped again: the hosts' copies are reused
  ship_wall_s             the first, wall clock (peer: unshipped)
  ship_dir_rss_mb         `troupe torchrun --ship-working-dir`, one rank per
                          host, from a folder that holds the same data set
                          (peer: the same run from a folder the hosts see)
  ship_dir_wall_s         the same, wall clock

Needs root and unshare (mount namespaces), numpy, and a build with troupe,
troupe-train and the Python package (--build-dir).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def log(msg):
    print(f"py_ship: {msg}", file=sys.stderr, flush=True)


def measured(cmd, env, cwd=None):
    """(peak RSS in MiB, wall seconds) of one run of `cmd`, which must succeed
    (the peak is at least this process's own at the fork: kept small)."""
    start = time.monotonic()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.monotonic() - start
    if os.waitstatus_to_exitcode(status) != 0:
        fail(f"{' '.join(cmd)} failed:\n{out.decode(errors='replace')[-3000:]}")
    if os.environ.get("PY_SHIP_VERBOSE"):
        log(f"{' '.join(cmd)}:\n{out.decode(errors='replace')[-2000:]}")
    return usage.ru_maxrss / 1024.0, wall


def fail(message):
    """An error row on stdout, where the figures go (a failure was said on
    stderr only), the message on stderr, and exit 1."""
    print(json.dumps({"bench": "py_ship", "case": "ship_driver_rss_mb", "error": message.splitlines()[0]}), flush=True)
    sys.exit(f"py_ship: {message}")


def row(case, value, unit, peer=None, **extra):
    r = {"bench": "py_ship", "case": case, "value": round(value, 2), "unit": unit, **extra}
    if peer is not None:
        r["peer"] = round(peer, 2)
        r["ratio"] = round(value / peer, 3)
    print(json.dumps(r), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--hosts", type=int, default=2, help="node agents, one trainer each (default 2)")
    ap.add_argument("--mb", type=int, default=300, help="size of the .npz in MiB (default 300)")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    if os.geteuid() != 0 or not shutil.which("unshare"):
        fail("needs root and unshare (node agents in mount namespaces)")
    build = os.path.abspath(a.build_dir)
    troupe = os.path.join(build, "launcher", "troupe")
    if not os.access(troupe, os.X_OK):
        fail(f"{troupe} is not built (bench/run py_ship builds it)")
    root = tempfile.mkdtemp(prefix="troupe-py-ship-")
    session = os.path.join(root, "session")
    os.mkdir(session, 0o700)
    env = dict(os.environ, TROUPE_SESSION_DIR=session, PYTHONPATH=os.path.join(build, "python"))
    hidden, visible = os.path.join(root, "hidden"), os.path.join(root, "visible")
    os.mkdir(hidden)
    os.mkdir(visible)
    rows = max(1, a.mb * (1 << 20) // (256 * 4 + 8))
    log(f"writing a {a.mb} MiB .npz ({rows} rows)")
    # In a process of its own: a child's peak RSS (wait4) starts from this
    # process's at the fork, which must stay small.
    subprocess.run([sys.executable, "-c", f"""
import numpy as np
x = np.random.default_rng(0).standard_normal(({rows}, 256), dtype=np.float32)
np.savez({os.path.join(hidden, "data.npz")!r}, input=x, target=x[:, :10].argmax(1).astype(np.int64))
"""], check=True, timeout=600)
    os.link(os.path.join(hidden, "data.npz"), os.path.join(visible, "data.npz"))
    # A torchrun project holding the data set, hidden from the hosts and
    # visible to them (hard links: the same bytes).
    script = f"""import os
size = os.path.getsize("data.npz")
assert size == {os.path.getsize(os.path.join(hidden, "data.npz"))}, size
print("rank", os.environ["RANK"], "sees", size, "bytes", flush=True)
"""
    for folder in (hidden, visible):
        os.mkdir(os.path.join(folder, "project"))
        os.link(os.path.join(folder, "data.npz"), os.path.join(folder, "project", "data.npz"))
        with open(os.path.join(folder, "project", "train.py"), "w") as f:
            f.write(script)
    agents = []
    try:
        subprocess.run([troupe, "start", "--head", "--port", "0", "--resources", "CPU=0"], env=env, check=True,
                       stdout=subprocess.DEVNULL, timeout=120)
        address = open(os.path.join(session, "address")).read().strip()
        token = open(os.path.join(session, "token")).read().strip()
        for i in range(a.hosts):
            own = os.path.join(root, f"agent{i}")
            os.mkdir(own, 0o700)
            agents.append(subprocess.Popen(
                ["unshare", "-m", "--propagation", "private", "sh", "-c",
                 'mount -t tmpfs tmpfs "$1" && exec "$2" start --address "$3" --resources CPU=2 --block',
                 "sh", hidden, troupe, address],
                env=dict(env, TROUPE_SESSION_DIR=own, TROUPE_TOKEN=token), stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL))
        subprocess.run([sys.executable, "-c", f"""
import time, troupe
troupe.init(address="auto")
deadline = time.monotonic() + 120
while sum(1 for n in troupe.nodes() if n["Alive"]) < {1 + a.hosts}:
    assert time.monotonic() < deadline, "the node agents never joined"
    time.sleep(0.2)
"""], env=env, check=True, timeout=180)

        def train(data, *extra):
            ck = tempfile.mkdtemp(dir=root)
            return measured([troupe, "train", "--address", "auto", "--model", "mlp", "--model-option", "input_dim=256",
                             "--model-option", "hidden=64", "--model-option", "num_classes=10", "--data", data,
                             "--workers", str(a.hosts), "--cpus-per-worker", "2", "--batch-size", "256",
                             "--max-steps", str(a.steps), "--log-every", "10", "--checkpoint-dir", ck, *extra], env)

        log(f"shipping to {a.hosts} host(s), then again (cached), then unshipped")
        fresh = train(os.path.join(hidden, "data.npz"), "--ship-files")
        cached = train(os.path.join(hidden, "data.npz"), "--ship-files")
        plain = train(os.path.join(visible, "data.npz"))
        row("ship_driver_rss_mb", fresh[0], "MiB", plain[0], hosts=a.hosts, file_mb=a.mb)
        row("ship_cached_rss_mb", cached[0], "MiB", plain[0], hosts=a.hosts, file_mb=a.mb)
        row("ship_wall_s", fresh[1], "s", plain[1], hosts=a.hosts, file_mb=a.mb)

        def torchrun(folder, *extra):
            return measured([troupe, "torchrun", "--address", "auto", "--nnodes", str(a.hosts), "--nproc-per-node",
                             "1", "--python", sys.executable, *extra, "train.py"], env,
                            cwd=os.path.join(folder, "project"))

        log(f"torchrun: the working directory shipped to {a.hosts} host(s), then unshipped")
        shipped_dir = torchrun(hidden, "--ship-working-dir")
        plain_dir = torchrun(visible)
        row("ship_dir_rss_mb", shipped_dir[0], "MiB", plain_dir[0], hosts=a.hosts, file_mb=a.mb)
        row("ship_dir_wall_s", shipped_dir[1], "s", plain_dir[1], hosts=a.hosts, file_mb=a.mb)
    finally:
        subprocess.run([troupe, "stop"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
        for p in agents:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
