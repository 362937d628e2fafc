"""Scheduling strategies on a two-node cluster (a head and a second node
agent, real processes): NodeAffinitySchedulingStrategy pins tasks and
actors (hard) or prefers a node (soft); a hard actor dies with its node,
a soft one restarts elsewhere; "SPREAD" spreads."""
import os
import signal
import subprocess

import pytest

import troupe
from conftest import cli, in_session, session_env, wait_until
from timebox import bounded_fixture
from troupe.exceptions import ActorDiedError, ConfigError
from troupe.util.scheduling_strategies import NodeAffinitySchedulingStrategy

bounded = bounded_fixture(240)


@pytest.fixture()
def two_nodes(tmp_path):
    launcher = cli()
    session, env = session_env(tmp_path)
    subprocess.run([launcher, "start", "--head", "--port", "0", "--resources", "CPU=2"], env=env, check=True,
                   timeout=120)
    address = (session / "address").read_text().strip()
    token = (session / "token").read_text().strip()
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    out = subprocess.run([launcher, "start", "--address", address, "--resources", "CPU=2"],
                         env=dict(env, TROUPE_SESSION_DIR=str(other), TROUPE_TOKEN=token), capture_output=True,
                         text=True, timeout=120, check=True).stdout
    # "node 2 started (pid N), joined ..."
    second = int(out.split("node ", 1)[1].split()[0])
    pid = int(out.split("(pid ", 1)[1].split(")")[0])
    with in_session(session):
        try:
            troupe.init(address=address)
            yield {"second": str(second), "second_pid": pid}
        finally:
            troupe.shutdown()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            subprocess.run([launcher, "stop"], env=env, timeout=120)


@troupe.remote
def where():
    return troupe.get_runtime_context().get_node_id()


@troupe.remote
class Where:
    def node(self):
        return troupe.get_runtime_context().get_node_id()


def _on(node, soft=False):
    return NodeAffinitySchedulingStrategy(node_id=node, soft=soft)


def test_hard_affinity_pins_tasks_and_actors_to_each_node(two_nodes):
    nodes = sorted(n["NodeID"] for n in troupe.nodes() if n["Alive"])
    assert len(nodes) == 2 and two_nodes["second"] in nodes
    for node in nodes:
        assert set(troupe.get([where.options(scheduling_strategy=_on(node)).remote() for _ in range(6)],
                              timeout=60)) == {node}
        actors = [Where.options(num_cpus=1, scheduling_strategy=_on(node)).remote() for _ in range(2)]
        assert troupe.get([a.node.remote() for a in actors], timeout=60) == [node, node]
        for a in actors:
            troupe.kill(a)


def test_hard_affinity_to_a_node_that_is_not_there_is_refused_by_name(two_nodes):
    with pytest.raises(ConfigError, match="node 99 does not exist"):
        Where.options(scheduling_strategy=_on("99")).remote()
    with pytest.raises(ConfigError, match="node 99 does not exist"):
        troupe.get(where.options(scheduling_strategy=_on(99)).remote(), timeout=60)
    with pytest.raises(ConfigError, match="more than node"):
        Where.options(num_cpus=3, scheduling_strategy=_on(two_nodes["second"])).remote()
    # A task too big for its one node is told so, not that no node fits.
    with pytest.raises(ConfigError, match=f"do not fit on node {two_nodes['second']} .*hard node affinity"):
        where.options(num_cpus=3, scheduling_strategy=_on(two_nodes["second"])).remote()
    with pytest.raises(ValueError, match="not a troupe node id"):
        NodeAffinitySchedulingStrategy("abc", soft=False)
    with pytest.raises(ConfigError, match="SPREAD"):
        where.options(scheduling_strategy="PACK").remote()
    # A soft affinity to a node that is not there places as usual.
    assert troupe.get(where.options(scheduling_strategy=_on("99", soft=True)).remote(), timeout=60)


def test_soft_affinity_waits_for_its_busy_node_as_rays_does(two_nodes):
    second = two_nodes["second"]
    full = Where.options(num_cpus=2, scheduling_strategy=_on(second)).remote()
    assert troupe.get(full.node.remote(), timeout=60) == second
    # The other node has room, but a soft affinity spills only from a node
    # that is gone or too small in all: it waits for the busy one.
    soft = Where.options(num_cpus=1, scheduling_strategy=_on(second, soft=True)).remote()
    answer = soft.node.remote()
    ready, _ = troupe.wait([answer], timeout=0.5)
    assert not ready
    troupe.kill(full)
    assert troupe.get(answer, timeout=60) == second
    with pytest.raises(ValueError, match="_spill_on_unavailable"):
        NodeAffinitySchedulingStrategy(second, soft=True, _spill_on_unavailable=True)


def test_spread_puts_actors_on_both_nodes(two_nodes):
    actors = [Where.options(num_cpus=1, scheduling_strategy="SPREAD").remote() for _ in range(2)]
    assert len(set(troupe.get([a.node.remote() for a in actors], timeout=60))) == 2


def test_a_hard_actor_dies_with_its_node_and_a_soft_one_restarts_elsewhere(two_nodes):
    second = two_nodes["second"]
    hard = Where.options(num_cpus=1, max_restarts=1, scheduling_strategy=_on(second)).remote()
    soft = Where.options(num_cpus=1, max_restarts=1, scheduling_strategy=_on(second, soft=True)).remote()
    assert troupe.get([hard.node.remote(), soft.node.remote()], timeout=60) == [second, second]
    os.kill(two_nodes["second_pid"], signal.SIGKILL)
    wait_until(lambda: not any(n["Alive"] for n in troupe.nodes() if n["NodeID"] == second),
               what="the head seeing the node dead")
    with pytest.raises(ActorDiedError, match="hard affinity"):
        troupe.get(hard.node.remote(), timeout=60)
    assert troupe.get(soft.node.remote(), timeout=60) != second


def test_tasks_of_parts_of_gpus_fit_as_the_head_places_them():
    """The task submitter counts how many executors the nodes hold as the
    head places them: parts of a GPU on one device each. A node with half
    a GPU runs tasks of a quarter (counting by whole devices refused them
    as fitting no node)."""
    troupe.init(num_cpus=2, num_gpus=0.5)
    try:
        @troupe.remote(num_gpus=0.25)
        def quarter():
            return troupe.get_gpu_ids()

        assert troupe.get([quarter.remote() for _ in range(3)], timeout=120) == [[0]] * 3
    finally:
        troupe.shutdown()
