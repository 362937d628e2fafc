"""troupe.util.state: Ray's state API (ray.util.state) on the head's status.

    from troupe.util.state import list_actors, list_nodes
    alive = list_actors(filters=[("state", "=", "ALIVE"), ("class_name", "=", "Trainer")])

list_actors, list_nodes and list_placement_groups return dataclasses (the
fields Ray's have where troupe has them, and a few of troupe's own; read as
attributes or, as Ray's rows allow, as row["state"] and row.get(...));
get_* returns one or None; summarize_actors counts actors by class and
state. Filters are (column, "=" or "!=", value) tuples, compared as strings
and, for text, without regard to case, as Ray's (an unknown column or
predicate is a ConfigError naming it); `limit` bounds what is returned
after filtering (Ray's default, 100). `timeout` is checked and taken for
Ray's signature: the head answers a status request without waiting.

Everything comes from one status request to the head of the current
session (troupe status --json reads the same): actors and groups are the
head's tables, which keep the latest dead actors and removed groups only
(docs/runtime.md). A Python task runs on hidden executor actors: they are
not listed, as Ray lists no task workers among actors. Ray's list_tasks
and list_objects have no counterpart: tasks and objects do not go through
the head in troupe (each owner keeps its own).
"""
import dataclasses
import json
from typing import Dict, List, Optional

from troupe.exceptions import ConfigError

DEFAULT_LIMIT = 100
_PREDICATES = ("=", "!=")
_EXECUTOR_CLASS = "TaskExecutor"  # runtime/client/task.h: a task executor's class
# The head's actor states by Ray's names (a created actor waiting to be
# placed is Ray's PENDING_CREATION).
_RAY_STATE = {"PENDING": "PENDING_CREATION"}


class _Row:
    """Ray's state rows are read as attributes and as a dict."""

    def __getitem__(self, key):
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def __setitem__(self, key, value):
        setattr(self, key, value)

    def get(self, key, default=None):
        return getattr(self, key, default)


@dataclasses.dataclass
class ActorState(_Row):
    actor_id: str
    class_name: str
    state: str  # PENDING_CREATION, ALIVE, RESTARTING or DEAD (Ray's DEPENDENCIES_UNREADY has no counterpart)
    name: str  # "" when unnamed
    ray_namespace: str  # the namespace of a named actor ("" otherwise)
    node_id: Optional[str]  # None while it is placed nowhere
    pid: Optional[int]
    num_restarts: int
    max_restarts: int
    death_cause: Optional[str]  # None unless DEAD
    pending_reason: Optional[str]  # troupe's: why it waits to be placed
    address: Optional[str]  # troupe's: where its worker takes calls


@dataclasses.dataclass
class NodeState(_Row):
    node_id: str
    node_ip: str
    node_name: str  # the hostname its agent reported
    state: str  # ALIVE or DEAD
    resources_total: Dict[str, float]
    resources_used: Dict[str, float]  # troupe's: what actors hold now
    idle_workers: int  # troupe's: warm pooled workers
    pid: int  # troupe's: the node agent's process


@dataclasses.dataclass
class PlacementGroupState(_Row):
    placement_group_id: str
    name: str  # "" when unnamed
    state: str  # PENDING, CREATED or REMOVED
    strategy: str
    bundle_nodes: List[Optional[str]]  # the node of each bundle (None: not placed)
    pending_reason: Optional[str]


def _status(address, timeout, actor_state=""):
    import troupe

    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ConfigError(f"troupe.util.state: timeout must be a number of seconds > 0, got {timeout!r}")
    client = troupe._client()
    if address is not None and address not in ("auto", client.address):
        raise ConfigError(f"troupe.util.state: address {address!r} is not this session's cluster "
                          f"({client.address}); call troupe.init(address=...) for another one")
    return json.loads(client.status_json(actor_state, 0))


def _text(value):
    return None if value in ("", 0, None) else str(value)


def _actors(status):
    out = []
    for a in status.get("actors", []):
        if a["class"] == _EXECUTOR_CLASS:
            continue
        namespace, _, name = a["name"].rpartition("/")
        state = _RAY_STATE.get(a["state"], a["state"])
        out.append(ActorState(
            actor_id=str(a["id"]), class_name=a["class"], state=state, name=name, ray_namespace=namespace,
            node_id=_text(a["node"]), pid=a["pid"] or None, num_restarts=a["restarts"],
            max_restarts=a["max_restarts"],
            # The head keeps why it last died across a restart; Ray's is
            # None until the actor is dead.
            death_cause=(a["death_cause"] or None) if state == "DEAD" else None,
            pending_reason=a["pending_reason"] or None, address=a["address"] or None))
    return out


def _nodes(status):
    return [NodeState(node_id=str(n["id"]), node_ip=n["address"], node_name=n["hostname"],
                      state="ALIVE" if n["alive"] else "DEAD", resources_total=dict(n["total"]),
                      resources_used=dict(n["used"]), idle_workers=n["idle_workers"], pid=n["pid"])
            for n in status.get("nodes", [])]


def _bundle_nodes(g):
    """One node per bundle; None for a bundle not placed (the head lists
    no nodes for a PENDING group)."""
    nodes = [_text(n) for n in g["bundle_nodes"]]
    return nodes + [None] * (len(g.get("bundles", ())) - len(nodes))


def _groups(status):
    return [PlacementGroupState(placement_group_id=str(g["id"]), name=g["name"], state=g["state"],
                                strategy=g["strategy"],
                                bundle_nodes=_bundle_nodes(g),
                                pending_reason=g["pending_reason"] or None)
            for g in status.get("placement_groups", [])]


def _filtered(rows, kind, filters, limit, what):
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ConfigError(f"troupe.util.state.{what}: limit must be an int >= 0, got {limit!r}")
    columns = [f.name for f in dataclasses.fields(kind)]
    if filters is not None and not isinstance(filters, (list, tuple)):
        raise ConfigError(f"troupe.util.state.{what}: filters is a list of (column, predicate, value), "
                          f"e.g. [(\"state\", \"=\", \"ALIVE\")], got {filters!r}")
    for f in filters or ():
        if not isinstance(f, (tuple, list)) or len(f) != 3:
            raise ConfigError(f"troupe.util.state.{what}: a filter is (column, predicate, value), got {f!r}")
        column, predicate, value = f
        if predicate not in _PREDICATES:
            raise ConfigError(f"troupe.util.state.{what}: filter predicate {predicate!r} is not one of "
                              f"{', '.join(_PREDICATES)}")
        if column not in columns:
            raise ConfigError(f"troupe.util.state.{what}: no column {column!r} to filter on (columns: "
                              f"{', '.join(columns)})")
        want = str(value).lower()
        rows = [r for r in rows if (str(getattr(r, column)).lower() == want) == (predicate == "=")]
    return rows if limit is None else rows[:limit]


def list_actors(address=None, filters=None, limit=DEFAULT_LIMIT, timeout=30, detail=False,
                raise_on_missing_output=True, _explain=False):
    """The actors the head knows (ids ascending), as ActorState."""
    return _filtered(_actors(_status(address, timeout)), ActorState, filters, limit, "list_actors")


def list_nodes(address=None, filters=None, limit=DEFAULT_LIMIT, timeout=30, detail=False,
               raise_on_missing_output=True, _explain=False):
    """The nodes the head knows, dead ones included, as NodeState."""
    return _filtered(_nodes(_status(address, timeout)), NodeState, filters, limit, "list_nodes")


def list_placement_groups(address=None, filters=None, limit=DEFAULT_LIMIT, timeout=30, detail=False,
                          raise_on_missing_output=True, _explain=False):
    """The placement groups the head knows, as PlacementGroupState."""
    return _filtered(_groups(_status(address, timeout)), PlacementGroupState, filters, limit,
                     "list_placement_groups")


def _by_id(rows, id_field, wanted):
    wanted = str(wanted)
    for r in rows:
        if getattr(r, id_field) == wanted:
            return r
    return None


def get_actor(id, address=None, timeout=30, _explain=False):
    """The actor of that id (an ActorHandle's id, or get_actor_id()), or None."""
    return _by_id(_actors(_status(address, timeout)), "actor_id", id)


def get_node(id, address=None, timeout=30, _explain=False):
    return _by_id(_nodes(_status(address, timeout)), "node_id", id)


def get_placement_group(id, address=None, timeout=30, _explain=False):
    return _by_id(_groups(_status(address, timeout)), "placement_group_id", getattr(id, "id", id))


def summarize_actors(address=None, timeout=30, raise_on_missing_output=True, _explain=False):
    """Actors counted by class and state, shaped as Ray's summary."""
    summary = {}
    actors = _actors(_status(address, timeout))
    for a in actors:
        row = summary.setdefault(a.class_name, {"class_name": a.class_name, "state_counts": {}})
        row["state_counts"][a.state] = row["state_counts"].get(a.state, 0) + 1
    return {"cluster": {"summary": summary, "total_actors": len(actors), "summary_by": "class"}}
