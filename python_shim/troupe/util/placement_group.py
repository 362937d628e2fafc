"""Placement groups as in Ray's ray.util.placement_group: a set of resource
bundles the head reserves together (PACK, SPREAD, STRICT_PACK,
STRICT_SPREAD), then actors and tasks placed into a bundle with
PlacementGroupSchedulingStrategy. The runtime's own placement groups do the
work (the head reserves and releases bundles, actors in a group that is
still pending wait for it); nothing here schedules.

    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
    troupe.get(pg.ready())
    a = Actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote()
    remove_placement_group(pg)
"""

import math

from troupe import _timeouts
from troupe.exceptions import ConfigError

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class PlacementGroupID(int):
    """A group's id: the head's number, with Ray's PlacementGroupID.hex()."""

    def hex(self):
        return f"{int(self):016x}"


def _client():
    import troupe

    return troupe._client()


def _client_of(pg):
    """The process's client, if `pg` was made in this session."""
    import troupe

    return troupe._same_session(pg._client, f"placement group {pg.id}")


def _bundle(i, bundle):
    if not isinstance(bundle, dict) or not bundle:
        raise ConfigError(f"placement group bundle {i} must be a non-empty dict of resources, got {bundle!r}")
    out = {}
    for k, v in bundle.items():
        # A bool is no amount (as num_cpus=True is refused), nor is NaN or
        # an infinity.
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"placement group bundle {i}: {k}={v!r} is not a non-negative number")
        try:
            amount = float(v)
        except OverflowError:
            amount = math.inf
        if not 0 <= amount < math.inf:
            raise ConfigError(f"placement group bundle {i}: {k}={v!r} is not a non-negative number")
        out[str(k)] = amount
    if not any(out.values()):
        # As Ray's: it would reserve nothing, and hold nothing for what is
        # placed in it.
        raise ConfigError(f"placement group bundle {i} asks for no resource ({bundle!r}); a bundle needs more than "
                          "0 of one at least")
    return out


class PlacementGroup:
    """A handle on a placement group; pickles (ids travel to tasks and actors)."""

    def __init__(self, id, bundle_specs):
        self.id = PlacementGroupID(id)
        self.bundle_specs = [dict(b) for b in bundle_specs]
        self._bind()

    def _bind(self):
        # The session this handle names a group of (the id is its cluster's).
        import troupe

        self._client = troupe._current_client()

    def __getstate__(self):
        return {"id": self.id, "bundle_specs": self.bundle_specs}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.id = PlacementGroupID(self.id)
        self._bind()

    @property
    def bundle_count(self):
        return len(self.bundle_specs)

    def ready(self):
        """An ObjectRef that resolves to this group once every bundle is
        reserved (troupe.get / troupe.wait on it); it fails if the group is
        removed first."""
        from troupe import _serialization as ser

        return _client_of(self).placement_group_ready(self.id, ser.dumps(self))

    def wait(self, timeout_seconds=30):
        """True once every bundle is reserved, False at the timeout."""
        timeout_seconds = _timeouts.seconds(timeout_seconds, "PlacementGroup.wait", "timeout_seconds", none_ok=False)
        return _client_of(self).wait_placement_group(self.id, timeout_seconds)["state"] == "CREATED"

    def __eq__(self, other):
        return isinstance(other, PlacementGroup) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def __repr__(self):
        return f"PlacementGroup(id={self.id}, bundles={self.bundle_specs})"


def placement_group(bundles, strategy="PACK", name="", lifetime=None):
    """Reserves `bundles` (a list of resource dicts) with `strategy`. Returns
    at once; the group is PENDING until the cluster has room (see ready()).
    With lifetime="detached" the group outlives this driver, as Ray's (it
    was removed at the driver's exit, killing the detached actors in it):
    only remove_placement_group or the cluster's end frees it."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown placement strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
    if lifetime not in (None, "detached"):
        raise ConfigError(f"lifetime must be None or 'detached', got {lifetime!r}")
    if not isinstance(bundles, (list, tuple)) or not bundles:
        raise ConfigError(f"a placement group needs a non-empty list of bundles, got {bundles!r}")
    specs = [_bundle(i, b) for i, b in enumerate(bundles)]
    client = _client()
    if name:
        # A name is one live group's, as Ray's: a second reserved the
        # resources again, and get_placement_group(name) found the older.
        # (Checked here, by this API: two made at the same instant may
        # both pass; the runtime's own groups are not held to it.)
        for g in _head_groups(client):
            if g.get("name") == str(name) and g["state"] != "REMOVED":
                raise ConfigError(f"a placement group named {str(name)!r} already exists (id {g['id']}); remove it "
                                  "first or choose another name")
    info = client.create_placement_group(specs, strategy, str(name or ""), lifetime == "detached")
    return PlacementGroup(info["id"], specs)


def remove_placement_group(pg):
    """Releases the group's bundles; actors placed in it are killed."""
    pg = _as_group(pg)
    _client_of(pg).remove_placement_group(pg.id)


def _head_groups(client):
    """The head's placement groups (status rows: id, name, bundles, state)."""
    import json

    # limit=1: the groups are what is asked for, not the actors.
    return json.loads(client.status_json(limit=1)).get("placement_groups", [])


def _handle(client, group_id):
    """A handle on group `group_id` with its bundles as the head has them."""
    client.placement_group_info(int(group_id))  # its error: a group the head does not know
    row = next((g for g in _head_groups(client) if g["id"] == int(group_id)), {})
    return PlacementGroup(group_id, row.get("bundles", []))


def get_placement_group(name_or_id):
    """As Ray's get_placement_group(name): the live group of that name
    (ValueError when there is none); an int finds the group with that id,
    and so do digits that name no group (a group named "7" is found by
    its name). The handle has the group's bundles."""
    client = _client()
    if isinstance(name_or_id, int) and not isinstance(name_or_id, bool):
        return _handle(client, name_or_id)
    if not isinstance(name_or_id, str) or not name_or_id:
        raise ConfigError(f"get_placement_group takes a group's name (or id), not {name_or_id!r}")
    for g in _head_groups(client):
        if g.get("name") == name_or_id and g["state"] != "REMOVED":
            return PlacementGroup(g["id"], g.get("bundles", []))
    if name_or_id.isdigit():
        return _handle(client, int(name_or_id))
    raise ValueError(f"no placement group named {name_or_id!r} (removed ones are not found)")


def get_current_placement_group():
    """As Ray's: inside an actor or a task placed in a placement group,
    that group, with its bundles (to place more work beside it); None in a
    driver and in work placed outside any group."""
    from troupe import _core

    group = _core.placement_group_id()
    return _handle(_client(), group) if group else None


def _table_row(g):
    """A group of the head's status as Ray's placement_group_table shows
    one (placement_group_id, name, bundles, bundles_to_node_id, strategy,
    state, stats), with troupe's own keys beside them (id, bundle_nodes,
    pending_reason)."""
    # A PENDING group that lost bundles with a node still holds the others
    # (their node is named; 0 is a bundle to place).
    placed = g["state"] != "REMOVED"
    row = {
        "placement_group_id": str(g["id"]),
        "name": g.get("name", ""),
        "bundles": {i: dict(b) for i, b in enumerate(g.get("bundles", []))},
        "bundles_to_node_id": {i: str(n) for i, n in enumerate(g["bundle_nodes"]) if n} if placed else {},
        "strategy": g["strategy"],
        "state": g["state"],
        "stats": {"scheduling_state": {"CREATED": "FINISHED", "REMOVED": "REMOVED"}.get(g["state"], "PENDING")},
    }
    row.update({"id": g["id"], "bundle_nodes": g["bundle_nodes"], "pending_reason": g.get("pending_reason", "")})
    return row


def placement_group_table(pg=None):
    """As Ray's: the head's view of one group (a dict: its id, name,
    bundles, the node of each bundle, strategy, state; also why it is
    pending), or without pg every group the head has, by id."""
    client = _client() if pg is None else _client_of(_as_group(pg))
    rows = {g["id"]: _table_row(g) for g in _head_groups(client)}
    if pg is None:
        return rows
    if pg.id not in rows:
        client.placement_group_info(pg.id)  # its error: a group the head does not know
        raise ConfigError(f"placement group {pg.id} is not in the head's table")
    return rows[pg.id]


def _as_group(pg):
    if not isinstance(pg, PlacementGroup):
        raise TypeError(f"expected a PlacementGroup, got a {type(pg).__name__}")
    return pg
