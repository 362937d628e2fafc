"""preload_modules (troupe's own actor and task option): the worker imports
the modules before it serves, so a pooled worker already has them loaded
when it is handed the actor (TorchTrainer preloads torch this way). A
module that fails to import is skipped, bad values are refused."""
import sys

import pytest

import troupe
from troupe.exceptions import ConfigError

PROBE = "wave"  # a standard module that neither troupe nor pytest imports


@troupe.remote
class Probe:
    def loaded(self, name):
        return name in sys.modules


@troupe.remote
def loaded_in_task(name):
    return name in sys.modules


def test_preloaded_before_the_actor_starts(cluster):
    assert PROBE not in sys.modules
    warm = Probe.options(preload_modules=[PROBE]).remote()
    plain = Probe.remote()
    assert troupe.get(warm.loaded.remote(PROBE), timeout=60) is True
    assert troupe.get(plain.loaded.remote(PROBE), timeout=60) is False
    assert troupe.get(loaded_in_task.options(preload_modules=[PROBE]).remote(PROBE), timeout=60) is True


def test_a_module_that_fails_to_preload_is_skipped(cluster):
    a = Probe.options(preload_modules=["no_such_module_for_troupe", PROBE]).remote()
    assert troupe.get(a.loaded.remote(PROBE), timeout=60) is True
    assert troupe.get(a.loaded.remote("no_such_module_for_troupe"), timeout=60) is False


def test_bad_preload_values_are_refused(cluster):
    for bad in ("torch", ["os;rm -rf"], [""], [3], ["a..b"]):
        with pytest.raises(ConfigError, match="preload_modules"):
            Probe.options(preload_modules=bad).remote()
