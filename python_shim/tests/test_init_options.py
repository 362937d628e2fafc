"""Ray's init() options that troupe honours: object_store_memory (the
driver's object store limit) and logging_level; bad values are named."""
import logging
import os

import numpy as np
import pytest

import troupe
from troupe.exceptions import ConfigError, ObjectStoreFullError


@pytest.fixture
def restore_env():
    saved = {k: os.environ.get(k) for k in ("TROUPE_OBJECT_STORE_BYTES", "TROUPE_LOG_LEVEL")}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_object_store_memory_limits_what_a_process_keeps(restore_env):
    troupe.init(num_cpus=1, object_store_memory=1 << 20, logging_level=logging.ERROR)
    try:
        assert os.environ["TROUPE_LOG_LEVEL"] == "error"
        with pytest.raises(ObjectStoreFullError, match="object store full"):  # Ray's class
            troupe.put(np.zeros(1 << 18))  # 2 MiB
        assert troupe.get(troupe.put(np.zeros(1 << 10)), timeout=60).shape == (1 << 10,)
    finally:
        troupe.shutdown()


def test_bad_init_options_are_named(restore_env):
    for bad in (-1, 0, 1.5, True, "1G"):
        with pytest.raises(ConfigError, match="object_store_memory"):
            troupe.init(object_store_memory=bad)
    with pytest.raises(ConfigError, match="logging_level"):
        troupe.init(logging_level="loud")
    with pytest.raises(ConfigError, match="object_store_memory"):
        troupe.init("127.0.0.1:1", object_store_memory=1 << 20)
    assert not troupe.is_initialized()
