"""troupe.util.collective (Ray's ray.util.collective) over gloo between
actor processes: every operation's values, the driver's declared groups,
re-forming a group, bad input named, and a member's death failing the
others' operation instead of hanging it."""
import os

import numpy as np
import pytest

import troupe
import troupe.util.collective as col
from troupe.exceptions import CollectiveAbortedError, ConfigError
from troupe.util.collective.types import ReduceOp

pytestmark = pytest.mark.usefixtures("cluster")

torch = pytest.importorskip("torch")


@troupe.remote(num_cpus=0)
class Member:
    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def init(self, group="default"):
        col.init_collective_group(self.world, self.rank, backend="gloo", group_name=group)
        return col.get_rank(group), col.get_collective_group_size(group), col.is_group_initialized(group)

    def everything(self, group="default"):
        r, n = self.rank, self.world
        out = {}
        a = np.full(4, r + 1, dtype=np.float32)
        col.allreduce(a, group)
        out["sum"] = a.tolist()
        t = torch.full((2, 3), float(r), dtype=torch.bfloat16)
        col.allreduce(t, group, op=ReduceOp.MAX)
        out["max_bf16"] = t.float().flatten().tolist()
        b = np.arange(3, dtype=np.int64) * (r + 10)
        col.broadcast(b, src_rank=1, group_name=group)
        out["broadcast"] = b.tolist()
        parts = [torch.zeros(2, dtype=torch.float64) for _ in range(n)]
        col.allgather(parts, torch.tensor([r, r * r], dtype=torch.float64), group)
        out["allgather"] = [p.tolist() for p in parts]
        mine = np.zeros(2, dtype=np.int32)
        col.reducescatter(mine, [np.full(2, r * 100 + k, dtype=np.int32) for k in range(n)], group)
        out["reducescatter"] = mine.tolist()
        c = np.full(2, float(r + 1), dtype=np.float64)
        col.reduce(c, dst_rank=2, group_name=group, op=ReduceOp.PRODUCT)
        out["reduce"] = c.tolist()
        col.barrier(group)
        # A ring: each sends to the next and receives from the previous.
        # A send returns once its peer has received (as Ray's): rank 0
        # sends first, the others receive first.
        got = np.zeros(3, dtype=np.float32)
        mine = np.full(3, float(r), dtype=np.float32)
        if r == 0:
            col.send(mine, 1, group)
            col.recv(got, n - 1, group)
        else:
            col.recv(got, r - 1, group)
            col.send(mine, (r + 1) % n, group)
        out["ring"] = got.tolist()
        return out

    def allreduce(self, value, group="default"):
        a = np.array([value], dtype=np.float64)
        col.allreduce(a, group)
        return float(a[0])

    def destroy(self, group="default"):
        col.destroy_collective_group(group)
        return col.is_group_initialized(group), col.get_rank(group)

    def misuse(self, group="default"):
        errors = []
        for bad in (lambda: col.allreduce(np.zeros(2, dtype=np.complex64), group),
                    lambda: col.allreduce(np.zeros((4, 4), dtype=np.float32)[:, 0], group),
                    lambda: col.allreduce(np.frombuffer(b"\0" * 8, dtype=np.float32), group),
                    lambda: col.allreduce([1.0, 2.0], group),
                    lambda: col.allreduce(np.zeros(2, dtype=np.float32), group, op="MEDIAN"),
                    lambda: col.send(np.zeros(2, dtype=np.float32), self.rank, group),
                    lambda: col.reducescatter(np.zeros(2, np.int32), [np.full(1, 5, np.int32)] * self.world, group),
                    lambda: col.reduce(np.frombuffer(b"\0" * 16), dst_rank=self.rank, group_name=group),
                    lambda: col.allreduce(np.zeros(2, dtype=np.float32), "never-formed")):
            try:
                bad()
                errors.append(None)
            except Exception as e:  # noqa: BLE001 - each misuse's error is the result
                errors.append(f"{type(e).__name__}: {e}")
        return errors

    def disagree(self, group="default"):
        # Each rank asks for something else: a size, a dtype, a message length.
        errors = []
        n = 1000 if self.rank == 1 else 5
        errors.append(_error_text(lambda: col.allreduce(np.ones(n, dtype=np.float32), group)))
        errors.append(_error_text(lambda: col.broadcast(
            np.ones(8, dtype=np.int64 if self.rank else np.float64), 0, group)))
        mine = np.full(2, self.rank + 1.0)
        errors.append(_error_text(lambda: col.reduce(mine, dst_rank=self.rank, group_name=group)))
        errors.append(mine.tolist() == [self.rank + 1.0] * 2)
        if self.rank == 0:
            errors.append(_error_text(lambda: col.send(np.ones(1000, dtype=np.float32), 1, group)))
        else:
            got = np.zeros(10, dtype=np.float32)
            errors.append(_error_text(lambda: col.recv(got, 0, group)))
            errors.append(got.tolist() == [0.0] * 10)
        parts = [np.zeros(3), np.zeros(7) if self.rank == 1 else np.zeros(3)]
        parts.reverse()  # rank 1's bad entry first
        errors.append(_error_text(lambda: col.allgather(parts, np.ones(3), group)))
        a = np.full(2, self.rank + 1.0)
        col.allreduce(a, group)  # the group goes on
        return errors, a.tolist()

    def pid(self):
        return os.getpid()

    def try_init(self, world, rank, timeout_ms, group="default"):
        try:
            col.init_collective_group(world, rank, backend="gloo", group_name=group, gloo_timeout=timeout_ms)
            return "joined"
        except Exception as e:  # noqa: BLE001 - the error is the result
            return f"{type(e).__name__}: {e}"

    def stuck_then_destroyed(self):
        # An allreduce the peer never joins, in a thread of this member's,
        # while this call destroys the group.
        import threading
        import time

        failed = []
        t = threading.Thread(target=lambda: failed.append(_error_of(lambda: col.allreduce(np.zeros(2), "u"))))
        t.start()
        deadline = time.monotonic() + 60
        while not col._groups["u"].lock.locked():  # the thread is in its operation (polled, bounded)
            if time.monotonic() > deadline:
                raise TimeoutError("the operation's thread never started")
            time.sleep(0.01)
        started = time.monotonic()
        col.destroy_collective_group("u")
        t.join(timeout=60)
        return failed, time.monotonic() - started


def _error_of(fn):
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001 - the error is the result
        return type(e).__name__


def _error_text(fn):
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}"


def _members(n):
    return [Member.remote(r, n) for r in range(n)]


def test_every_operation_of_a_gloo_group_between_actors():
    members = _members(3)
    assert troupe.get([m.init.remote() for m in members], timeout=120) == [(r, 3, True) for r in range(3)]
    results = troupe.get([m.everything.remote() for m in members], timeout=120)
    for r, out in enumerate(results):
        assert out["sum"] == [6.0] * 4
        assert out["max_bf16"] == [2.0] * 6
        assert out["broadcast"] == [0, 11, 22]
        assert out["allgather"] == [[0.0, 0.0], [1.0, 1.0], [2.0, 4.0]]
        assert out["reducescatter"] == [0 + 100 + 200 + 3 * r] * 2
        assert out["reduce"] == ([6.0, 6.0] if r == 2 else [float(r + 1)] * 2)
        assert out["ring"] == [float((r - 1) % 3)] * 3
    # Bad input is named, and the group survives it.
    errors = troupe.get(members[0].misuse.remote(), timeout=60)
    assert "dtype complex64 is not one a group moves" in errors[0]
    assert "is not contiguous" in errors[1]
    assert "is read-only" in errors[2]
    assert "a list is neither a numpy array nor a torch tensor" in errors[3]
    assert "op must be a ReduceOp" in errors[4]
    assert "destination rank 0 is not another member" in errors[5]
    # An entry of another shape was broadcast into its slot; a read-only
    # destination of a reduce was numpy's ValueError after both exchanges.
    assert "reducescatter: tensor_list[0] is a ndarray of shape (1,)" in errors[6], errors[6]
    assert errors[7].startswith("ConfigError: collective reduce: the array is read-only"), errors[7]
    assert "'never-formed' is not initialized in this process" in errors[8]
    assert troupe.get([m.allreduce.remote(r) for r, m in enumerate(members)], timeout=60) == [3.0] * 3
    # Destroyed and formed again (a new generation), under the same name.
    assert troupe.get([m.destroy.remote() for m in members], timeout=60) == [(False, -1)] * 3
    assert troupe.get([m.init.remote() for m in members], timeout=120) == [(r, 3, True) for r in range(3)]
    assert troupe.get([m.allreduce.remote(10 * r) for r, m in enumerate(members)], timeout=60) == [30.0] * 3


def test_members_that_pass_different_tensors_get_an_error_and_keep_the_group():
    # gloo's transport thread aborted the process that received more bytes
    # than it posted (as torch.distributed's gloo does); both members now
    # fail the operation with a ConfigError naming each rank's call.
    members = _members(2)
    troupe.get([m.init.remote() for m in members], timeout=120)
    (errors0, sum0), (errors1, sum1) = troupe.get([m.disagree.remote() for m in members], timeout=120)
    assert sum0 == sum1 == [3.0, 3.0]
    for errors in (errors0, errors1):
        assert errors[0].startswith("ConfigError: allreduce of collective group"), errors[0]
        assert "rank 0: allreduce of 5 float32 (sum); rank 1: allreduce of 1000 float32 (sum)" in errors[0]
        assert "rank 0: broadcast of 8 float64 from rank 0; rank 1: broadcast of 8 int64 from rank 0" in errors[1]
    for errors in (errors0, errors1):  # each named itself the root: each kept the whole sum
        assert "the members passed different dst_rank (from 0 to 1" in errors[2], errors[2]
        assert errors[3] is True
    assert errors0[4] is None  # the send completes; the receive refuses it
    assert "rank 0 sent 1000 float32 and this receive takes 10 float32" in errors1[4], errors1[4]
    assert errors1[5] is True  # nothing landed in the receive's array
    # A list entry that cannot take a member's tensor is named on its own
    # member, after the exchange, and the others are not held up.
    assert errors0[-1] is None
    assert "tensor_list[0] has shape (7,), not the tensor's (3,)" in errors1[-1], errors1[-1]


def test_a_group_the_driver_declares_is_joined_at_the_first_operation():
    members = _members(2)
    col.create_collective_group(members, 2, [1, 0], backend="gloo", group_name="declared")
    assert troupe.get([m.allreduce.remote(r + 1, "declared") for r, m in enumerate(members)], timeout=120) == [3.0] * 2
    with pytest.raises(ConfigError, match="ranks must be 0..1"):
        col.create_collective_group(members, 2, [0, 0], backend="gloo", group_name="bad")
    with pytest.raises(ConfigError, match="backend must be 'gloo' or 'nccl'"):
        col.create_collective_group(members, 2, [0, 1], backend="mpi", group_name="bad")
    col.destroy_collective_group("declared")


def test_a_members_death_fails_the_others_operation_instead_of_hanging_it():
    members = _members(2)
    troupe.get([m.init.remote() for m in members], timeout=120)
    waiting = members[0].allreduce.remote(1.0)  # rank 1 never joins this allreduce
    troupe.kill(members[1])
    with pytest.raises(CollectiveAbortedError, match="rank 1"):
        troupe.get(waiting, timeout=120)


def test_a_name_forms_again_after_a_timeout_a_resize_or_another_job():
    # Each forming is rank 0's: before, counters kept per rank drifted apart
    # after a forming that timed out, and the name never formed again.
    a, b, c = Member.options(max_concurrency=2).remote(0, 2), Member.remote(1, 2), Member.remote(2, 3)
    late = troupe.get(a.try_init.remote(2, 0, 1000, "g"), timeout=60)
    assert "rank(s) 1 of 2 did not join within 1000 ms" in late, late
    assert troupe.get([a.try_init.remote(2, 0, 30000, "g"), b.try_init.remote(2, 1, 30000, "g")],
                      timeout=120) == ["joined"] * 2
    assert troupe.get([a.allreduce.remote(1.0, "g"), b.allreduce.remote(2.0, "g")], timeout=60) == [3.0] * 2
    # Three members under the same name, after the two destroyed it.
    troupe.get([a.destroy.remote("g"), b.destroy.remote("g")], timeout=60)
    assert troupe.get([m.try_init.remote(3, r, 30000, "g") for r, m in enumerate((a, b, c))],
                      timeout=120) == ["joined"] * 3
    assert troupe.get([m.allreduce.remote(1.0, "g") for m in (a, b, c)], timeout=60) == [3.0] * 3
    # A member that destroys the group while another thread of its own waits
    # in an operation: the operation fails at once (it waited for its 300 s).
    troupe.get([a.try_init.remote(2, 0, 30000, "u"), b.try_init.remote(2, 1, 30000, "u")], timeout=120)
    failed, took = troupe.get(a.stuck_then_destroyed.remote(), timeout=120)
    assert failed == ["CollectiveAbortedError"], failed
    assert col.Backend("GLOO") == "gloo" and col.gloo_available()


def test_a_groups_keys_are_its_namespaces_or_else_its_jobs(monkeypatch):
    # Drivers of one namespace meet (a detached actor made by an earlier
    # job, and a later job's actors); without a namespace each job is alone.
    class Context:
        def __init__(self, namespace):
            self.namespace = namespace

        def get_job_id(self):
            return "7@head:1"

    monkeypatch.setattr(troupe, "get_runtime_context", lambda: Context("svc"))
    assert col._base("g") == "troupe.collective/ns:svc/g"
    monkeypatch.setattr(troupe, "get_runtime_context", lambda: Context(""))
    assert col._base("g") == "troupe.collective/job:7@head:1/g"


OTHER_JOB = """
import sys

import troupe
import troupe.util.collective as col


@troupe.remote(num_cpus=0)
def rank0_of_x():
    try:
        col.init_collective_group(2, 0, backend="gloo", group_name="x", gloo_timeout=3000)
        return "joined"
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}"


troupe.init(address=sys.argv[1])
print(troupe.get(rank0_of_x.remote(), timeout=120))
troupe.shutdown()
"""


def test_two_jobs_using_one_group_name_at_once_do_not_pair_their_ranks(tmp_path):
    # Group names were cluster-wide: another job's rank 0 of "x" took this
    # job's waiting rank 1, and their allreduces summed two runs' data.
    import subprocess
    import sys

    a1 = Member.remote(1, 2)
    waiting = a1.try_init.remote(2, 1, 60000, "x")
    client = troupe._client()
    script = tmp_path / "other_job.py"
    script.write_text(OTHER_JOB)
    env = dict(os.environ, TROUPE_TOKEN=client.token, TROUPE_SESSION_DIR=str(tmp_path / "session"))
    env.pop("TROUPE_ADDRESS", None)
    other = subprocess.run([sys.executable, str(script), client.address], env=env, capture_output=True, text=True,
                           timeout=180)
    assert other.returncode == 0, other.stderr
    assert "rank(s) 1 of 2 did not join" in other.stdout, other.stdout
    a0 = Member.remote(0, 2)
    assert troupe.get([a0.try_init.remote(2, 0, 60000, "x"), waiting], timeout=120) == ["joined"] * 2
    assert troupe.get([a0.allreduce.remote(1.0, "x"), a1.allreduce.remote(2.0, "x")], timeout=60) == [3.0] * 2


@troupe.remote(num_cpus=0)
class JoinsInItsConstructor:
    def __init__(self, rank):
        col.init_collective_group(2, rank, backend="gloo", group_name="ctor")

    def allreduce(self, value):
        a = np.array([value], dtype=np.float64)
        col.allreduce(a, "ctor")
        return float(a[0])


def test_a_group_formed_in_the_members_constructors():
    # Rank 0 announced its forming while still PENDING (in __init__), and
    # rank 1 took that for a rank 0 that had ended: it never joined.
    members = [JoinsInItsConstructor.remote(r) for r in range(2)]
    assert troupe.get([m.allreduce.remote(r + 1.0) for r, m in enumerate(members)], timeout=120) == [3.0, 3.0]
