"""troupe.util.state, as Ray's ray.util.state: actors, nodes and placement
groups as the head sees them, with Ray's filters and limit; the executors
of tasks are not listed; bad filters are named."""
import pytest

import troupe
from conftest import wait_until
from timebox import bounded_fixture
from troupe.exceptions import ConfigError
from troupe.util import placement_group, remove_placement_group
from troupe.util.state import (ActorState, get_actor, get_node, get_placement_group, list_actors, list_nodes,
                               list_placement_groups, summarize_actors)

pytestmark = pytest.mark.usefixtures("cluster")
bounded = bounded_fixture(240)


@troupe.remote(num_cpus=0)
class Keeper:
    def me(self):
        ctx = troupe.get_runtime_context()
        return ctx.get_actor_id(), ctx.get_node_id()


@troupe.remote(num_cpus=0)
class Other:
    def ping(self):
        return "pong"


@troupe.remote
def task():
    return 1


def test_actors_are_listed_filtered_and_found_by_id():
    keeper = Keeper.options(name="state-keeper").remote()
    others = [Other.remote() for _ in range(2)]
    keeper_id, node_id = troupe.get(keeper.me.remote(), timeout=60)
    assert troupe.get([o.ping.remote() for o in others], timeout=60) == ["pong", "pong"]
    assert troupe.get(task.remote(), timeout=60) == 1  # a task: its executor is no actor of the user's
    troupe.kill(others[1])
    wait_until(lambda: len(list_actors(filters=[("class_name", "=", "Other"), ("state", "=", "DEAD")])) == 1,
               60, "the killed actor to be DEAD")

    actors = list_actors(limit=None)
    assert all(isinstance(a, ActorState) for a in actors)
    assert "TaskExecutor" not in {a.class_name for a in actors}
    mine = get_actor(keeper_id)
    assert (mine.class_name, mine.name, mine.state, mine.node_id) == ("Keeper", "state-keeper", "ALIVE", node_id)
    # As Ray's rows: also read as a dict; text filters ignore case.
    assert (mine["state"], mine.get("name"), mine.get("no such field", "-")) == ("ALIVE", "state-keeper", "-")
    assert [a.actor_id for a in list_actors(filters=[("name", "=", "STATE-KEEPER")])] == [keeper_id]
    assert mine.pid and mine.address and mine.death_cause is None
    assert get_actor("999999999") is None
    alive_others = list_actors(filters=[("class_name", "=", "Other"), ("state", "!=", "DEAD")])
    assert len(alive_others) == 1 and alive_others[0].state == "ALIVE"
    dead = list_actors(filters=[("class_name", "=", "Other"), ("state", "=", "DEAD")])[0]
    assert dead.death_cause
    assert len(list_actors(filters=[("class_name", "=", "Other")], limit=1)) == 1
    summary = summarize_actors()["cluster"]
    assert summary["summary"]["Other"]["state_counts"] == {"ALIVE": 1, "DEAD": 1}
    assert summary["summary"]["Keeper"]["state_counts"] == {"ALIVE": 1}
    assert summary["total_actors"] == len(actors)


def test_nodes_and_placement_groups():
    nodes = list_nodes()
    assert [(n.state, n.resources_total.get("CPU")) for n in nodes] == [("ALIVE", 2.0)]
    node = nodes[0]
    assert node.node_id == troupe.get_runtime_context().get_node_id()
    assert node.node_ip and node.node_name and node.pid > 0
    stable = ("node_id", "state", "node_ip", "node_name", "pid", "resources_total")
    assert [getattr(get_node(node.node_id), f) for f in stable] == [getattr(node, f) for f in stable]
    assert get_node("424242") is None

    pg = placement_group([{"CPU": 1}], strategy="SPREAD", name="state-group")
    troupe.get(pg.ready(), timeout=60)
    listed = get_placement_group(pg)
    assert (listed.name, listed.state, listed.strategy, listed.bundle_nodes) == (
        "state-group", "CREATED", "SPREAD", [node.node_id])
    assert list_placement_groups(filters=[("name", "=", "state-group")]) == [listed]
    remove_placement_group(pg)
    wait_until(lambda: get_placement_group(pg).state == "REMOVED", 60, "the group to be removed")
    assert listed.placement_group_id in {g.placement_group_id for g in
                                         list_placement_groups(filters=[("state", "=", "REMOVED")])}


def test_bad_filters_and_options_are_named():
    with pytest.raises(ConfigError, match="no column 'colour'.*class_name"):
        list_actors(filters=[("colour", "=", "red")])
    with pytest.raises(ConfigError, match="predicate '>'"):
        list_nodes(filters=[("state", ">", "ALIVE")])
    with pytest.raises(ConfigError, match=r"\(column, predicate, value\)"):
        list_actors(filters=["state=ALIVE"])
    with pytest.raises(ConfigError, match="filters is a list of .*got 'state=alive'"):
        list_actors(filters="state=alive")
    with pytest.raises(ConfigError, match="limit must be an int >= 0, got -1"):
        list_placement_groups(limit=-1)
    with pytest.raises(ConfigError, match="timeout"):
        list_actors(timeout=0)
    with pytest.raises(ConfigError, match="is not this session's cluster"):
        list_actors(address="10.0.0.1:6380")


def test_the_heads_rows_become_rays():
    """A waiting actor is Ray's PENDING_CREATION; a death cause shows on a
    dead actor only (the head keeps the last one across a restart); an
    unplaced bundle has no node."""
    from troupe.util import state

    row = {"id": 7, "class": "A", "name": "ns/a", "node": 0, "pid": 0, "address": "", "restarts": 1,
           "max_restarts": 2, "pending_reason": "no room", "death_cause": "killed by signal 9"}
    waiting, = state._actors({"actors": [dict(row, state="PENDING")]})
    assert (waiting.state, waiting.death_cause, waiting.node_id, waiting.pid) == ("PENDING_CREATION", None, None, None)
    assert (waiting.name, waiting.ray_namespace, waiting.pending_reason) == ("a", "ns", "no room")
    dead, = state._actors({"actors": [dict(row, state="DEAD")]})
    assert dead.death_cause == "killed by signal 9"
    executor, = state._actors({"actors": [dict(row, state="ALIVE", **{"class": "TaskExecutor"}), dict(row, state="ALIVE")]})
    assert executor.class_name == "A"
    group, = state._groups({"placement_groups": [{"id": 3, "name": "", "state": "REMOVED", "strategy": "PACK",
                                                  "bundle_nodes": [0, 4], "pending_reason": ""}]})
    assert group.bundle_nodes == [None, "4"] and group.pending_reason is None
    # A PENDING group's bundles are on no node yet: one None each (the head
    # lists no nodes for it), not an empty list.
    pending, = state._groups({"placement_groups": [{"id": 4, "name": "", "state": "PENDING", "strategy": "PACK",
                                                    "bundles": [{"CPU": 1}, {"CPU": 50}], "bundle_nodes": [],
                                                    "pending_reason": "no node"}]})
    assert pending.bundle_nodes == [None, None]
