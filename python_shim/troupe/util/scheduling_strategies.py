"""Scheduling strategies as in Ray's ray.util.scheduling_strategies. troupe
places by resources (the head picks the least loaded node that fits, which
also serves Ray's "SPREAD") unless an actor or task is put into a
placement group bundle or given a node affinity."""

from troupe.util.placement_group import PlacementGroup


class PlacementGroupSchedulingStrategy:
    """Run in `placement_group`, in bundle `placement_group_bundle_index`
    (-1 = any bundle with room); with placement_group_capture_child_tasks,
    its child tasks and actors run in the group too."""

    def __init__(self, placement_group, placement_group_bundle_index=-1,
                 placement_group_capture_child_tasks=None):
        if not isinstance(placement_group, PlacementGroup):
            raise TypeError(f"placement_group must be a PlacementGroup, got a {type(placement_group).__name__}")
        index = placement_group_bundle_index
        if not isinstance(index, int) or index < -1:
            raise ValueError(f"placement_group_bundle_index must be an int >= -1, got {index!r}")
        if placement_group.bundle_specs and index >= placement_group.bundle_count:
            raise ValueError(f"placement_group_bundle_index {index} is out of range for a group of "
                             f"{placement_group.bundle_count} bundles")
        self.placement_group = placement_group
        self.placement_group_bundle_index = index
        # True: the tasks and actors that this one starts run in the same
        # group (any bundle), and theirs too, unless they name a strategy.
        self.placement_group_capture_child_tasks = bool(placement_group_capture_child_tasks)


class NodeAffinitySchedulingStrategy:
    """Run on node `node_id` (a node's "NodeID" in troupe.nodes(), or
    get_runtime_context().get_node_id()), as Ray's. soft=False: only
    there, waiting for room; a node that does not exist or is dead is a
    ConfigError at the call, and an actor whose node dies is not restarted
    elsewhere. soft=True: there while that node is alive and big enough in
    all (waiting for room, as Ray), else wherever the cluster places it.
    Ray's _spill_on_unavailable and _fail_on_unavailable are not supported
    (a ValueError when set)."""

    def __init__(self, node_id, soft, _spill_on_unavailable=False, _fail_on_unavailable=False):
        if isinstance(node_id, bool) or not isinstance(node_id, (str, int)):
            raise TypeError(f"node_id must be a node's id (a str such as '1'), got {node_id!r}")
        try:
            number = int(node_id)
        except ValueError:
            raise ValueError(f"node_id {node_id!r} is not a troupe node id (troupe.nodes()' NodeID)") from None
        if number <= 0:
            raise ValueError(f"node_id must be a positive node id, got {node_id!r}")
        if not isinstance(soft, bool):
            raise TypeError(f"soft must be a bool, got {soft!r}")
        if _spill_on_unavailable or _fail_on_unavailable:
            raise ValueError("NodeAffinitySchedulingStrategy: _spill_on_unavailable and _fail_on_unavailable are "
                             "not supported")
        self.node_id = str(number)
        self.soft = soft
        self._spill_on_unavailable = _spill_on_unavailable
        self._fail_on_unavailable = _fail_on_unavailable
