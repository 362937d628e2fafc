"""Bounds every test of a module: `bounded_fixture(seconds)` makes an
autouse fixture that fails the test (TimeoutError) after `seconds` and, if the
main thread is stuck where a Python signal handler cannot run (inside a
blocking native call), has faulthandler end the whole run 30 s later."""

import faulthandler
import signal

import pytest


def bounded_fixture(seconds):
    @pytest.fixture(autouse=True)
    def bounded(request):
        def on_alarm(signum, frame):
            raise TimeoutError(f"{request.node.name} ran past {seconds} s")

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(seconds)
        faulthandler.dump_traceback_later(seconds + 30, exit=True)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)

    return bounded
