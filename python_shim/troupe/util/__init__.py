"""Ray's ray.util, as far as troupe has it: placement groups and scheduling
strategies (troupe.util.placement_group, troupe.util.scheduling_strategies),
ActorPool (troupe.util.actor_pool), Queue (troupe.util.queue), a
multiprocessing Pool (troupe.util.multiprocessing), the state API
(troupe.util.state), collective groups (troupe.util.collective),
list_named_actors and get_node_ip_address."""

from troupe.util.actor_pool import ActorPool
from troupe.util.placement_group import (PlacementGroup, get_current_placement_group, get_placement_group,
                                         placement_group, placement_group_table, remove_placement_group)

__all__ = ["ActorPool", "PlacementGroup", "get_current_placement_group", "get_placement_group", "placement_group",
           "placement_group_table", "remove_placement_group", "list_named_actors", "get_node_ip_address",
           "inspect_serializability"]


def inspect_serializability(obj, name=None, depth=3, print_file=None):
    """As Ray's: whether `obj` pickles as troupe sends it (cloudpickle), and
    if not, what inside it does not: its closure's variables, the globals
    its code uses, its attributes, its items, up to `depth` levels, each
    failure printed with its path. Returns (serializable, failures): a set
    of (path, type name) of the innermost values that fail."""
    import sys

    import cloudpickle

    out = print_file or sys.stdout
    failures = set()

    def pickles(value):
        try:
            cloudpickle.dumps(value)
            return True
        except Exception:  # noqa: BLE001 - any reason it cannot travel
            return False

    def parts(value):
        code = getattr(value, "__code__", None)
        if code is not None:
            for cell_name, cell in zip(code.co_freevars, getattr(value, "__closure__", None) or ()):
                try:
                    yield cell_name, cell.cell_contents
                except ValueError:  # an empty cell
                    continue
            globs = getattr(value, "__globals__", {})
            for g in code.co_names:
                if g in globs:
                    yield g, globs[g]
            return
        if isinstance(value, dict):
            yield from ((repr(k), v) for k, v in value.items())
        elif isinstance(value, (list, tuple, set, frozenset)):
            yield from ((f"[{i}]", v) for i, v in enumerate(value))
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            yield from vars(value).items()

    def walk(value, path, level):
        if pickles(value):
            return True
        print(f"{'  ' * level}{path} ({type(value).__name__}) cannot be pickled", file=out)
        inner = False
        if level < depth:
            for part, v in parts(value):
                if not walk(v, f"{path}.{part}", level + 1):
                    inner = True
        if not inner:
            failures.add((path, type(value).__name__))
        return False

    ok = walk(obj, name or getattr(obj, "__name__", type(obj).__name__), 0)
    return ok, failures


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


def get_node_ip_address():
    """The IP address of the node the caller runs on, as Ray's: in a task or
    an actor, its node's address as the head has it (what the cluster's
    other processes reach it at); in a driver, the address of this machine
    towards the head. What code gives to its peers as MASTER_ADDR."""
    import socket

    import troupe
    from troupe import _core

    client = troupe._client()
    actor = _core.actor_id()
    if actor:
        node = str(client.actor_info(actor)["node_id"])
        for n in client.nodes():
            if n["NodeID"] == node and n["NodeManagerAddress"]:
                return n["NodeManagerAddress"]
    host = client.address.rpartition(":")[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet goes: the kernel picks the route
        return s.getsockname()[0]
