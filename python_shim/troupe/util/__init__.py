"""Ray's ray.util, as far as troupe has it: placement groups and scheduling
strategies (troupe.util.placement_group, troupe.util.scheduling_strategies),
ActorPool (troupe.util.actor_pool), Queue (troupe.util.queue), a
multiprocessing Pool (troupe.util.multiprocessing), the state API
(troupe.util.state) and list_named_actors."""

from troupe.util.actor_pool import ActorPool
from troupe.util.placement_group import (PlacementGroup, get_placement_group, placement_group,
                                         placement_group_table, remove_placement_group)

__all__ = ["ActorPool", "PlacementGroup", "get_placement_group", "placement_group", "placement_group_table",
           "remove_placement_group", "list_named_actors"]


def list_named_actors(all_namespaces=False):
    """The named actors alive (not DEAD), as Ray's: their names in this
    session's namespace, or with all_namespaces=True a dict per actor,
    {"name": ..., "namespace": ...}, of every namespace."""
    import troupe
    from troupe.util import state

    if not isinstance(all_namespaces, bool):
        raise troupe.exceptions.ConfigError(f"list_named_actors: all_namespaces must be True or False, "
                                            f"got {all_namespaces!r}")
    here = troupe._namespace()
    named = [a for a in state.list_actors(limit=None) if a.name and a.state != "DEAD"]
    if all_namespaces:
        return [{"name": a.name, "namespace": a.ray_namespace} for a in named]
    return [a.name for a in named if a.ray_namespace == here]
