"""A task function's pickle stays in the head's KV store only while a
process that stored it is connected: the driver that ran it, or another
driver that stored the same function (the same hash) meanwhile."""
import select
import subprocess
import sys


import troupe
from troupe import _remote
from conftest import wait_until


def reference(client_id, fn_hash):
    """The key by which a client holds a function (as it holds a runtime_env
    package): the head erases the function when the last one goes."""
    return f"troupe.client/{client_id}/ref/{_remote._FUNCTION_KEY}{fn_hash}"

HELPER = """
def work(x):
    return x + 1
"""

# Stores `work` (by reference: the same pickle, the same hash, in every
# driver that runs this script), runs it, prints the hash and its client's
# id; with "hold", stays connected until its stdin closes.
DRIVER = """
import sys

import troupe
from fnkeys_helper import work

troupe.init(address=sys.argv[1], log_to_driver=False)
task = troupe.remote(work)
assert troupe.get(task.remote(1), timeout=60) == 2
print(task._shared["hash"], troupe._client().client_id, flush=True)
if sys.argv[2] == "hold":
    sys.stdin.read()
troupe.shutdown()
"""


def test_a_task_function_leaves_the_kv_store_with_its_last_holder(head, tmp_path):
    env, address = head
    (tmp_path / "fnkeys_helper.py").write_text(HELPER)
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    troupe.init(address=address)
    client = troupe._client()

    def stored(fn_hash):
        return client.kv_get(_remote._FUNCTION_KEY + fn_hash) is not None

    holder = subprocess.Popen([sys.executable, str(script), address, "hold"], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Bounded: a driver that never prints fails the test, not hangs it.
        ready, _, _ = select.select([holder.stdout], [], [], 120)
        line = holder.stdout.readline().split() if ready else []
        assert len(line) == 2, holder.stderr.read() if holder.poll() is not None else line
        fn_hash = line[0]
        assert stored(fn_hash)
        # A second driver stores the same function and ends: the function
        # stays for the first one (its reference went, the first's not).
        done = subprocess.run([sys.executable, str(script), address, "plain"], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        other_hash, other_id = done.stdout.split()
        assert other_hash == fn_hash
        wait_until(lambda: client.kv_get(reference(int(other_id), fn_hash)) is None,
                   what="the ended driver's reference to go")
        assert stored(fn_hash)
        # The last holder ends: the function goes with it.
        holder.stdin.close()
        assert holder.wait(timeout=120) == 0, holder.stderr.read()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=60)
    wait_until(lambda: not stored(fn_hash), what="the function of drivers that all ended to go")


def test_a_function_stored_again_after_it_went_still_runs(head):
    """This process stores a function, the head erases it meanwhile (as
    when its holders all ended): a new session stores it again."""
    env, address = head

    @troupe.remote
    def triple(x):
        return 3 * x

    troupe.init(address=address)
    assert troupe.get(triple.remote(2), timeout=60) == 6
    fn_hash = triple._shared["hash"]
    troupe.shutdown()
    troupe.init(address=address)
    client = troupe._client()
    wait_until(lambda: client.kv_get(_remote._FUNCTION_KEY + fn_hash) is None,
               what="the function of a session that ended to go")
    assert troupe.get(triple.remote(3), timeout=60) == 9
    assert client.kv_get(reference(client.client_id, fn_hash)) is not None
