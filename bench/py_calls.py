#!/usr/bin/python3
"""bench/run py_calls: Python tasks, actor calls and objects, troupe against Ray.

Cases (issue 15): `tasks_sync` and `tasks_async` (a trivial remote function,
one at a time / 1,000 in flight, tasks/s), `actor_sync` and `actor_async`
(1:1 calls of one actor's method, likewise, calls/s), `put_get_1MiB` and
`put_get_64MiB` (the driver puts a NumPy array, an actor in another process
gets it as a resolved argument and returns its size; GB/s of the round),
`tasks_nested` (fib(7) as tasks that wait in get for their two children:
41 tasks a tree, tasks/s), `generator_items` (a streaming generator task,
num_returns="streaming", yields 1,000 small values; the driver gets each
ref as it comes; values/s), `generator_calls` (streaming generator tasks
that yield one value each, one call at a time: what a stream costs a call,
beside `tasks_sync`; calls/s), `wait_loop` (wait(num_returns=1) over 4,000
finished refs until none is left, as programs take results as they come:
each wait sees all that are left; waits/s).

The same measuring code (`measure`) runs against either module: this script
starts itself once per runtime as a child (`--child MODULE`), so troupe and
Ray never share a process, collects the child's JSON rows and prints one row
per case with troupe's figure in `value`, Ray's in `ray` and `ratio` =
troupe / Ray. Ray comes from `import ray` in /usr/bin/python3 or, failing
that, from a venv the script creates under the build directory
(`pip install ray` from PyPI); its version is printed in every row.

    bench/py_calls.py [--seconds 3] [--build-dir build] [--only CASE,...]
                      [--num-cpus 4] [--ray-only | --troupe-only]

One JSON object per line on stdout; every wait is bounded (a child that
runs past --child-timeout is killed and becomes an error row).
"""

import argparse
import json
import os
import subprocess
import sys
import time

CASES = ["tasks_sync", "tasks_async", "actor_sync", "actor_async", "put_get_1MiB", "put_get_64MiB", "tasks_nested",
         "generator_items", "generator_calls", "wait_loop"]
UNITS = ({c: "tasks/s" for c in CASES[:2]} | {c: "calls/s" for c in CASES[2:4]} | {c: "GB/s" for c in CASES[4:6]}
         | {"tasks_nested": "tasks/s", "generator_items": "values/s", "generator_calls": "calls/s",
            "wait_loop": "waits/s"})
# generator_items: values one streaming generator task yields.
STREAM_VALUES = 1000
IN_FLIGHT = 1000
# tasks_nested: fib(NESTED_N) as tasks that wait for their two children
# (41 tasks, at most 6 deep, each waiting in get while its children run).
NESTED_N = 7
# wait_loop: wait(num_returns=1) over this many finished refs until none
# is left, as programs take results as they come (each wait sees the rest).
WAIT_REFS = 4000
SYSTEM_PYTHON = "/usr/bin/python3"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GET_TIMEOUT = 120.0


def row(case, **fields):
    """One JSON line, keys in the order given (bench, case first), flushed."""
    print(json.dumps({"bench": "py_calls", "case": case, **fields}), flush=True)


# ---------------------------------------------------------------- child side


def rate(one_batch, seconds, rounds=3):
    """Best of `rounds` rounds of `seconds / rounds` each: operations/s.
    `one_batch()` does some operations and returns how many (bytes for the
    object cases). Interleaving nothing else, best-of absorbs a loaded
    machine's pauses the same way for both runtimes."""
    best = 0.0
    for _ in range(rounds):
        done, t0 = 0, time.perf_counter()
        while True:
            done += one_batch()
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds / rounds:
                break
        best = max(best, done / elapsed)
    return best


def measure(rt, case, seconds):
    """Runs one case against module `rt` (ray or troupe, same API)."""
    import numpy as np

    @rt.remote
    def nop(x):
        return x

    @rt.remote
    class Echo:
        def echo(self, x):
            return x

        def nbytes(self, array):
            # The argument was a ref: the runtime fetched it into this
            # process before the call ("get in another process").
            return array.nbytes

    if case == "generator_items":

        @rt.remote(num_returns="streaming")
        def values(n):
            for i in range(n):
                yield i

        def one_stream():
            total = sum(rt.get(ref, timeout=GET_TIMEOUT) for ref in values.remote(STREAM_VALUES))
            if total != STREAM_VALUES * (STREAM_VALUES - 1) // 2:
                raise RuntimeError(f"generator_items: the values sum to {total}")
            return STREAM_VALUES

        one_stream()  # warm up
        return rate(one_stream, seconds)
    if case == "generator_calls":

        @rt.remote(num_returns="streaming")
        def one_value(x):
            yield x

        def one_call():
            refs = list(one_value.remote(7))
            if len(refs) != 1 or rt.get(refs[0], timeout=GET_TIMEOUT) != 7:
                raise RuntimeError("generator_calls: the generator did not yield its one value")
            return 1

        one_call()  # warm up
        return rate(one_call, seconds)
    if case == "wait_loop":
        refs = [nop.remote(i) for i in range(WAIT_REFS)]
        rt.get(refs, timeout=GET_TIMEOUT)

        def drain():
            left = list(refs)
            while left:
                _, left = rt.wait(left, num_returns=1)
            return WAIT_REFS

        drain()  # warm up
        return rate(drain, seconds)
    if case == "tasks_nested":

        @rt.remote
        def fib(n):
            if n < 2:
                return n
            return sum(rt.get([fib.remote(n - 1), fib.remote(n - 2)], timeout=GET_TIMEOUT))

        def tree(n):
            return 1 if n < 2 else 1 + tree(n - 1) + tree(n - 2)

        def one_tree():
            if rt.get(fib.remote(NESTED_N), timeout=GET_TIMEOUT) != 13:
                raise RuntimeError("tasks_nested: fib(7) is not 13")
            return tree(NESTED_N)

        one_tree()  # warm up
        return rate(one_tree, seconds)
    if case.startswith("tasks"):
        one = lambda: rt.get(nop.remote(1), timeout=GET_TIMEOUT) and 1
        many = lambda: len(rt.get([nop.remote(i) for i in range(IN_FLIGHT)], timeout=GET_TIMEOUT))
    elif case.startswith("actor"):
        actor = Echo.remote()
        rt.get(actor.echo.remote(0), timeout=GET_TIMEOUT)
        one = lambda: rt.get(actor.echo.remote(1), timeout=GET_TIMEOUT) and 1
        many = lambda: len(rt.get([actor.echo.remote(i) for i in range(IN_FLIGHT)], timeout=GET_TIMEOUT))
    else:
        size = (1 << 20) if case == "put_get_1MiB" else (64 << 20)
        array = np.ones(size, dtype=np.uint8)
        actor = Echo.remote()
        rt.get(actor.echo.remote(0), timeout=GET_TIMEOUT)

        def one():
            ref = rt.put(array)
            got = rt.get(actor.nbytes.remote(ref), timeout=GET_TIMEOUT)
            if got != size:
                raise RuntimeError(f"{case}: the actor got {got} bytes, expected {size}")
            del ref
            return size

        one()  # warm up: connections, first allocation
        return rate(one, seconds) / 1e9

    batch = many if case.endswith("async") else one
    batch()  # warm up: worker start, function export
    return rate(batch, seconds)


def child(module_name, cases, seconds, num_cpus):
    """Runs the cases against one runtime; prints {"case", "value"} rows."""
    import importlib

    t0 = time.perf_counter()
    rt = importlib.import_module(module_name)
    version = getattr(rt, "__version__", "unknown")
    if module_name == "ray":
        # Ray's extras that no case uses stay off (both are off in troupe).
        rt.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    else:
        rt.init(num_cpus=num_cpus)
    row("init", module=module_name, version=version, value=round(time.perf_counter() - t0, 3), unit="s")
    try:
        for case in cases:
            try:
                row(case, module=module_name, value=measure(rt, case, seconds))
            except Exception as e:  # one failing case must not hide the others
                row(case, module=module_name, error=f"{type(e).__name__}: {e}")
    finally:
        rt.shutdown()


# ---------------------------------------------------------------- driver side


def ray_python(build_dir):
    """An interpreter that imports ray: /usr/bin/python3 if it does, else the
    venv under the build directory, created (with the system site packages,
    for NumPy) and filled from PyPI on first use."""
    if subprocess.run([SYSTEM_PYTHON, "-c", "import ray"], capture_output=True).returncode == 0:
        return SYSTEM_PYTHON
    venv = os.path.join(build_dir, "ray-venv")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python) or subprocess.run([python, "-c", "import ray"], capture_output=True).returncode != 0:
        print(f"py_calls: installing ray from PyPI into {venv}", file=sys.stderr, flush=True)
        subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--system-site-packages", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "ray"], check=True, stdout=sys.stderr)
    return python


def troupe_env(build_dir):
    """The environment in which /usr/bin/python3 imports the troupe shim, or
    the reason it does not. Looks in what the CMake build writes
    (TROUPE_WITH_PYTHON), then in python_shim/ itself (a pip install -e or an
    in-tree extension); TROUPE_PYTHONPATH overrides both."""
    candidates = [os.environ.get("TROUPE_PYTHONPATH", "")] + [
        os.path.join(build_dir, "python_shim"),
        os.path.join(build_dir, "python"),
        os.path.join(REPO, "python_shim"),
    ]
    errors = []
    for path in filter(None, candidates):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH", "")])))
        probe = subprocess.run(
            [SYSTEM_PYTHON, "-c", "import troupe; troupe.init; troupe.remote"], capture_output=True, text=True, env=env
        )
        if probe.returncode == 0:
            return env, None
        errors.append(f"{path}: {(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    if subprocess.run([SYSTEM_PYTHON, "-c", "import troupe; troupe.init"], capture_output=True).returncode == 0:
        return dict(os.environ), None
    return None, "troupe python module not built (" + "; ".join(errors) + ")"


def run_child(python, env, module_name, args):
    """Runs this script as a child against one runtime; its rows by case."""
    cmd = [python, os.path.abspath(__file__), "--child", module_name, "--seconds", str(args.seconds),
           "--only", ",".join(args.cases), "--num-cpus", str(args.num_cpus)]
    results = {}
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
        stdout, stderr, rc = out.stdout, out.stderr, out.returncode
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr, rc = f"timed out after {args.child_timeout} s", -1
    for line in stdout.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and "case" in r:
            results[r["case"]] = r
    if rc != 0:
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        for case in args.cases:
            results.setdefault(case, {"error": f"{module_name} child exited {rc}: {tail}"})
    return results


def sig(x):
    """Three significant figures, the way the other benches round."""
    return float(f"{x:.3g}") if isinstance(x, (int, float)) else x


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=3.0, help="measuring time per case and runtime")
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--only", default=",".join(CASES), help="comma-separated cases")
    p.add_argument("--num-cpus", type=int, default=4, help="num_cpus given to init() of both runtimes")
    p.add_argument("--child-timeout", type=float, default=900.0)
    p.add_argument("--ray-only", action="store_true")
    p.add_argument("--troupe-only", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.cases = [c for c in args.only.split(",") if c]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; cases are {CASES}")
    if args.child:
        return child(args.child, args.cases, args.seconds, args.num_cpus)

    troupe, ray = {}, {}
    ray_version = None
    if not args.troupe_only:
        python = ray_python(args.build_dir)
        ray = run_child(python, dict(os.environ), "ray", args)
        ray_version = ray.get("init", {}).get("version")
        row("ray", version=ray_version, python=python, init_s=ray.get("init", {}).get("value"))
    if not args.ray_only:
        env, why_not = troupe_env(args.build_dir)
        if env is None:
            row("troupe", error=why_not)
            troupe = {c: {"error": "troupe python module not built"} for c in args.cases}
        else:
            troupe = run_child(SYSTEM_PYTHON, env, "troupe", args)
            row("troupe", version=troupe.get("init", {}).get("version"), python=SYSTEM_PYTHON,
                init_s=troupe.get("init", {}).get("value"))

    failed = False
    for case in args.cases:
        t, r = troupe.get(case, {}), ray.get(case, {})
        out = {"value": sig(t.get("value")), "unit": UNITS[case], "ray": sig(r.get("value"))}
        if out["value"] and out["ray"]:
            out["ratio"] = round(t["value"] / r["value"], 3)
        out["peer"] = f"ray {ray_version}" if ray_version else None
        if "error" in t:
            out["error"] = t["error"]
        if "error" in r:
            out["ray_error"] = r["error"]
        failed |= "error" in r or ("error" in t and not t["error"].startswith("troupe python module not built"))
        row(case, **{k: v for k, v in out.items() if v is not None or k == "value"})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main() or 0)
