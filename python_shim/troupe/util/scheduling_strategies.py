"""Scheduling strategies as in Ray's ray.util.scheduling_strategies. troupe
places by resources (the head picks the node) unless an actor or task is
put into a placement group bundle."""

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
