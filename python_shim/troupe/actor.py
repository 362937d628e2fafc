"""troupe.actor, as Ray's ray.actor: exit_actor() for an actor to end
itself."""
import atexit
import os
import threading

from troupe.exceptions import TroupeError

# How long the calling thread waits for the kill it asked for; past it the
# process ends itself.
_EXIT_WAIT_S = 60.0


def __getattr__(name):
    # Ray's ray.actor.ActorHandle and ActorClass, for code that imports
    # them from there (type hints, isinstance).
    if name in ("ActorHandle", "ActorClass", "ActorMethod"):
        from troupe import _remote

        return getattr(_remote, name)
    raise AttributeError(f"module 'troupe.actor' has no attribute {name!r}")


def exit_actor():
    """Ends the calling actor for good, as Ray's: its atexit handlers run,
    then the head kills its worker without a restart (whatever its
    max_restarts); the call that ran this, the calls queued behind it and
    later calls fail with ActorDiedError naming exit_actor(). TypeError in
    a driver or a task."""
    from troupe import _worker_hooks

    actor = _worker_hooks.user_actor_id()
    if not actor:
        raise TypeError("exit_actor() ends the actor whose method calls it; this is a driver or a task, not an actor")
    _end(actor, "the actor called exit_actor()")


def _end(actor, why):
    """exit_actor()'s work, with the death cause `why`."""
    from troupe import _client

    atexit._run_exitfuncs()
    try:
        _client().exit_actor(actor, why)
    except TroupeError:
        pass  # the head is out of reach: the process ends itself below
    # The kill ends this process; this thread does not return meanwhile, so
    # the caller sees the actor's death, not a value.
    threading.Event().wait(_EXIT_WAIT_S)
    os._exit(0)
