"""Ray's ray.util, as far as troupe has it: placement groups and scheduling
strategies (troupe.util.placement_group, troupe.util.scheduling_strategies),
ActorPool (troupe.util.actor_pool), Queue (troupe.util.queue) and a
multiprocessing Pool (troupe.util.multiprocessing)."""

from troupe.util.actor_pool import ActorPool
from troupe.util.placement_group import (PlacementGroup, get_placement_group, placement_group,
                                         placement_group_table, remove_placement_group)

__all__ = ["ActorPool", "PlacementGroup", "get_placement_group", "placement_group", "placement_group_table",
           "remove_placement_group"]
