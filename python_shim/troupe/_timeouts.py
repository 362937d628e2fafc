"""The check every public timeout of the package goes through (Ray's rule):
None waits without limit, a number of seconds >= 0 that long; a negative
number or NaN is refused, naming the value, instead of meaning "no wait"."""
import math
import numbers

from troupe.exceptions import ConfigError

# At or above this (about 31 years, infinity included) a timeout is no limit:
# the runtime's clocks cannot add a larger one.
_NO_LIMIT_S = 1e9


def seconds(value, where, name="timeout", none_ok=True):
    """value as float seconds (None for no limit), or a ConfigError (a
    ValueError) naming where, the parameter and the value."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name} must be a number of seconds, not {value!r}")
    value = float(value)
    if math.isnan(value) or value < 0:
        raise ConfigError(f"{where}: {name}={value!r} is not a number of seconds >= 0")
    if value >= _NO_LIMIT_S:
        return None if none_ok else _NO_LIMIT_S
    return value
