"""Placement groups from Python (troupe.util, as Ray's ray.util): a group is
reserved by the head, actors and tasks run in its bundles, a group that does
not fit stays pending, removing one kills its actors and gives the resources
back; bad options are refused with a clear error."""
import os

import pytest

import troupe
from troupe.exceptions import ActorDiedError, ConfigError, TroupeError
from troupe.util import get_current_placement_group, placement_group, placement_group_table, remove_placement_group
from troupe.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from conftest import wait_until


@troupe.remote
class Where:
    def node(self):
        return troupe.get_runtime_context().get_node_id()


@troupe.remote
def node_of_task():
    return troupe.get_runtime_context().get_node_id()


def in_bundle(pg, index):
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def test_a_pending_groups_kept_bundles_keep_their_node_in_the_table():
    # A group that lost a bundle with a node is PENDING while it places that
    # one again; the bundle it kept still runs where it is (probe 30a: Ray's
    # bundles_to_node_id read {} until the group was whole).
    from troupe.util.placement_group import _table_row
    row = _table_row({"id": 4, "state": "PENDING", "bundle_nodes": [7, 0], "strategy": "STRICT_SPREAD",
                      "bundles": [{"CPU": 1}, {"CPU": 1}]})
    assert row["bundles_to_node_id"] == {0: "7"}
    removed = _table_row({"id": 4, "state": "REMOVED", "bundle_nodes": [0, 0], "strategy": "PACK", "bundles": []})
    assert removed["bundles_to_node_id"] == {}


def test_actor_and_task_run_in_reserved_bundles(cluster):
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
    assert troupe.get(pg.ready(), timeout=60) == pg
    table = placement_group_table(pg)
    assert table["state"] == "CREATED"
    assert all(node for node in table["bundle_nodes"])
    # Ray's keys too, for code that reads them.
    assert table["placement_group_id"] == str(pg.id) and table["strategy"] == "PACK"
    assert table["bundles"] == {0: {"CPU": 1.0}, 1: {"CPU": 1.0}}
    assert table["bundles_to_node_id"] == {i: str(n) for i, n in enumerate(table["bundle_nodes"])}
    assert placement_group_table()[pg.id] == table
    wait_until(lambda: troupe.available_resources().get("CPU", 0) == 0, what="both CPUs reserved by the group")

    actor = Where.options(scheduling_strategy=in_bundle(pg, 0), num_cpus=1).remote()
    task = node_of_task.options(placement_group=pg, placement_group_bundle_index=1)
    assert int(troupe.get(actor.node.remote(), timeout=60)) == table["bundle_nodes"][0]
    assert int(troupe.get(task.remote(), timeout=60)) == table["bundle_nodes"][1]

    remove_placement_group(pg)

    def actor_is_dead():
        # The group's actors die with it; the kill lands asynchronously, so
        # a call made just after the removal may still be answered.
        try:
            troupe.get(actor.node.remote(), timeout=60)
        except ActorDiedError:
            return True
        return False

    wait_until(actor_is_dead, what="the group's actor killed with it")
    wait_until(lambda: troupe.available_resources().get("CPU", 0) == 2, what="the group's CPUs back in the pool")


def test_group_that_does_not_fit_stays_pending_until_removed(cluster):
    pg = placement_group([{"CPU": 64}])
    ready = pg.ready()
    done, pending = troupe.wait([ready], timeout=0.5)
    assert done == [] and pending == [ready]
    assert pg.wait(timeout_seconds=0.2) is False
    with pytest.raises(ValueError, match="timeout_seconds=-1.0"):
        pg.wait(timeout_seconds=-1)
    table = placement_group_table(pg)
    assert table["state"] == "PENDING" and table["pending_reason"]
    assert pg.id in placement_group_table()
    remove_placement_group(pg)
    with pytest.raises(TroupeError, match="removed"):
        troupe.get(ready, timeout=60)


def test_bad_placement_options_are_refused(cluster):
    with pytest.raises(ConfigError, match="strategy 'SIDEWAYS'"):
        placement_group([{"CPU": 1}], strategy="SIDEWAYS")
    with pytest.raises(ConfigError, match="non-empty list"):
        placement_group([])
    with pytest.raises(ConfigError, match="bundle 0"):
        placement_group([{"CPU": -1}])
    # As Ray's: a bundle of nothing but zeros is refused; a bool, NaN and
    # infinity are no amounts (num_cpus=True is refused alike).
    for bundles, message in [([{"CPU": 1}, {"CPU": 0}], r"bundle 1 asks for no resource \(\{'CPU': 0\}\)"),
                             ([{"CPU": 0, "GPU": 0.0}], "bundle 0 asks for no resource"),
                             ([{"CPU": True}], "bundle 0: CPU=True is not a non-negative number"),
                             ([{"CPU": float("nan")}], "bundle 0: CPU=nan is not"),
                             ([{"CPU": float("inf")}], "bundle 0: CPU=inf is not"),
                             ([{"CPU": 10**400}], "bundle 0: CPU=1000")]:
        with pytest.raises(ConfigError, match=message):
            placement_group(bundles)
    # Zero beside an amount is fine.
    zero_gpus = placement_group([{"CPU": 1, "GPU": 0}])
    assert zero_gpus.bundle_specs == [{"CPU": 1.0, "GPU": 0.0}]
    remove_placement_group(zero_gpus)
    pg = placement_group([{"CPU": 1}])
    try:
        with pytest.raises(ValueError, match="out of range"):
            in_bundle(pg, 3)
        with pytest.raises(ConfigError, match="'PACK' is not supported"):
            node_of_task.options(scheduling_strategy="PACK").remote()
        with pytest.raises(ConfigError, match="not both"):
            node_of_task.options(scheduling_strategy=in_bundle(pg, 0), placement_group=pg).remote()
        # More than the bundle holds would wait for ever: refused, naming both.
        assert troupe.get(pg.ready(), timeout=60) == pg
        with pytest.raises(ConfigError, match=r"asks for \{CPU=2\}, more than bundle 0 of placement group .* \{CPU=1\}"):
            Where.options(num_cpus=2, scheduling_strategy=in_bundle(pg, 0)).remote()
        with pytest.raises(ConfigError, match=r"more than any bundle of placement group"):
            Where.options(resources={"foo": 1}, scheduling_strategy=in_bundle(pg, -1)).remote()
        with pytest.raises(ConfigError, match=r"tasks \{CPU=2\} in placement group .*more than bundle 0"):
            troupe.get(node_of_task.options(num_cpus=2, scheduling_strategy=in_bundle(pg, 0)).remote(), timeout=60)
    finally:
        remove_placement_group(pg)


@troupe.remote
def child_in_group():
    return troupe.get_runtime_context().get_node_id()


@troupe.remote
def parent_in_group(timeout):
    # The group holds both CPUs of the cluster: this child can run only
    # in the group, on the CPU its parent lends while it waits.
    return troupe.get(child_in_group.remote(), timeout=timeout)


def test_a_group_that_captures_child_tasks_runs_them_inside(cluster):
    pg = placement_group([{"CPU": 2}])
    assert troupe.get(pg.ready(), timeout=60) == pg
    captured = PlacementGroupSchedulingStrategy(pg, placement_group_capture_child_tasks=True)
    node = troupe.get(parent_in_group.options(scheduling_strategy=captured).remote(60), timeout=90)
    assert int(node) == placement_group_table(pg)["bundle_nodes"][0]
    # Without capture the child waits outside the group for a CPU that the
    # group holds: the parent's get times out and says so.
    with pytest.raises(Exception, match="no result within 2 s"):
        troupe.get(parent_in_group.options(scheduling_strategy=in_bundle(pg, 0)).remote(2), timeout=90)
    remove_placement_group(pg)


@troupe.remote
def current_group():
    return get_current_placement_group(), troupe.get_runtime_context().get_placement_group_id()


@troupe.remote
class GroupMember:
    def group(self):
        return current_group.remote()  # a child placed in the member's group, as Ray's programs do


def test_work_in_a_group_knows_its_group(cluster):
    pg = placement_group([{"CPU": 1}])
    assert troupe.get(pg.ready(), timeout=60) == pg
    assert troupe.get(current_group.options(scheduling_strategy=in_bundle(pg, 0)).remote(), timeout=60) == (
        pg, str(pg.id))
    member = GroupMember.options(num_cpus=0, scheduling_strategy=in_bundle(pg, 0)).remote()
    child = troupe.get(member.group.remote(), timeout=60)
    assert troupe.get(child, timeout=60) == (None, None)  # not captured: the child runs outside
    assert troupe.get(current_group.remote(), timeout=60) == (None, None)
    assert get_current_placement_group() is None  # a driver is in no group
    assert troupe.get_runtime_context().get_placement_group_id() is None
    remove_placement_group(pg)


@troupe.remote
def current_group_bundles():
    g = get_current_placement_group()
    return g.bundle_count, g.bundle_specs


def test_a_group_found_inside_it_or_by_name_has_its_bundles(cluster):
    # Found inside the group (or by id) it had no bundles: bundle_count 0,
    # so `range(pg.bundle_count)` started no work. Ray finds groups by name.
    pg = placement_group([{"CPU": 1}, {"CPU": 0.5}], name="two-bundles")
    assert troupe.get(pg.ready(), timeout=60) == pg
    got = troupe.get(current_group_bundles.options(scheduling_strategy=in_bundle(pg, 0)).remote(), timeout=60)
    assert got == (2, [{"CPU": 1.0}, {"CPU": 0.5}])
    by_name = troupe.util.get_placement_group("two-bundles")
    assert by_name == pg and by_name.bundle_count == 2
    assert troupe.util.get_placement_group(pg.id).bundle_specs == [{"CPU": 1.0}, {"CPU": 0.5}]
    assert pg.id.hex() == f"{pg.id:016x}"  # Ray's PlacementGroupID.hex()
    with pytest.raises(ValueError, match="no placement group named 'nope'"):
        troupe.util.get_placement_group("nope")
    # A name is one live group's, as Ray's (a second reserved again, and
    # the name found the older); digits are a name first (a group named
    # "7" was looked up as id 7).
    with pytest.raises(ConfigError, match="a placement group named 'two-bundles' already exists"):
        placement_group([{"CPU": 0.5}], name="two-bundles")
    digits = placement_group([{"CPU": 0.1}], name=str(pg.id))
    assert troupe.util.get_placement_group(str(pg.id)) == digits
    remove_placement_group(digits)
    remove_placement_group(pg)
    with pytest.raises(ValueError, match="no placement group named 'two-bundles'"):
        troupe.util.get_placement_group("two-bundles")
    again = placement_group([{"CPU": 0.5}], name="two-bundles")  # free again once removed
    assert troupe.util.get_placement_group("two-bundles") == again
    remove_placement_group(again)


def test_a_task_queued_in_a_group_removed_before_it_ran_fails_naming_the_group(cluster):
    """It read "task executors ... died 3 times in a row before starting"
    (a WorkerCrashedError) after three leases no retry could start."""
    pg = placement_group([{"CPU": 64}])  # never fits: pending
    ref = node_of_task.options(placement_group=pg, placement_group_bundle_index=0).remote()
    remove_placement_group(pg)
    with pytest.raises(ConfigError) as e:
        troupe.get(ref, timeout=60)
    assert f"placement group {pg.id} was removed" in str(e.value), e.value
    assert "died" not in str(e.value), e.value


@troupe.remote
def runs_until(started, release):
    import os
    import time

    open(started, "w").close()
    while not os.path.exists(release):
        time.sleep(0.01)
    return "released"


def test_a_task_running_in_a_group_removed_fails_as_its_worker_was_killed(cluster, tmp_path):
    # Its retry could not run in the removed group, and that failure said
    # the task "cannot run" (a ConfigError), though it had run.
    from troupe.exceptions import WorkerCrashedError

    pg = placement_group([{"CPU": 1}])
    assert troupe.get(pg.ready(), timeout=60) == pg
    started = str(tmp_path / "started")
    ref = runs_until.options(placement_group=pg, placement_group_bundle_index=0).remote(
        started, str(tmp_path / "release"))
    wait_until(lambda: os.path.exists(started), what="the task started")
    remove_placement_group(pg)
    with pytest.raises(WorkerCrashedError) as e:
        troupe.get(ref, timeout=60)
    assert f"placement group {pg.id} was removed" in str(e.value), e.value
    assert "ran, and its worker was killed" in str(e.value), e.value

