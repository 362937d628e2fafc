"""What the driver's tasks and actors print, on the driver's console (Ray's
log_to_driver).

On an embedded cluster the workers share the driver's output already. On a
cluster started with `troupe start`, each worker writes to a file of its
own beside its node agent's log (docs/runtime.md, "Logs"), which is where
a print() in a task used to stay. A driver connected to such a cluster
follows those files: a thread asks the head now and then for its live
actors whose work is this driver's (the head's status names each actor's
driver, following owners through the actors that started them) and reads
what their workers' files gained since the last look, through the same
requests as `troupe logs`. Each line is printed with its worker's class and
pid, as Ray does: `(Counter pid=4242) hello`, `(task pid=4243) ...` for a
task's worker.

An actor that is no longer alive (it ended, or restarts) is read to the end
of its last worker's file and dropped; alive again, its new worker's file
is followed from its start; one seen with a new worker, or first seen after
a restart, has its previous worker's file read first (what a crash
printed). An actor that ended before any look saw it alive (a
constructor that raised, a task whose worker exited at once) is found
among the driver's latest dead actors and its worker's file read once,
whole. troupe.shutdown() reads everything once more (bounded), so a
task's last lines are not lost when the script ends right after it. Not
seen: a worker between two others that both came and went between two
looks, and actors beyond the DEAD_LOOKED_AT latest that died between two
looks."""
import json
import re
import sys
import threading
import time

# How often the files are looked at.
POLL_S = 0.25
# The most read from one file in one request, and how long a request may
# take (a node agent that does not answer costs one look, not the driver).
CHUNK_BYTES = 256 << 10
READ_TIMEOUT_S = 2.0
# Looks in a row that failed before it is said (once).
FAILURES_SAID = 20
# How long shutdown's last look may take in all.
CLOSE_BOUND_S = 5.0
# How many of the driver's newest dead actors a look asks for, and every
# how many looks (those that ended before a look saw them alive are read
# once, whole). Each dead row carries its cause (a traceback, say): asked
# for twice a second, not at every look.
DEAD_LOOKED_AT = 128
DEAD_EVERY = 2
# Dead actors remembered as read (oldest forgotten first): the head lists
# the highest ids, and an old one may come back into that list when newer
# rows are evicted.
ENDED_KEPT = 4096
RESTING_KEPT = 1024
_EXECUTOR_CLASS = "TaskExecutor"  # runtime/client/task.h
_WORKER_FILE = re.compile(r"worker-(\d+)\.log$")
# A line of the runtime's own log in a worker's file (runtime/core/logging.cc:
# "[12:34:56.789] [worker pid 4242] [info] ...", or an actor's worker's
# "[worker a17 pid 4242]"), and its level.
_RUNTIME_LINE = re.compile(r"^\[\d\d:\d\d:\d\d\.\d{3}\] \[\w+(?: a\d+)? pid \d+\] \[(\w+)\] ")
_LEVELS = ["trace", "debug", "info", "warning", "error", "critical", "off"]
# Labels this driver gives its own actors in place of their class's name
# ("TrainWorker rank=1", as an embedded cluster's worker marks its lines):
# actor id -> label, the oldest forgotten first.
_labels = {}
LABELS_KEPT = 4096


def label_actor(actor_id, label):
    """Marks the lines of actor `actor_id`'s workers `(label pid=N)` from
    now on (TorchTrainer: its ranks)."""
    _labels.pop(actor_id, None)
    _labels[actor_id] = label
    while len(_labels) > LABELS_KEPT:
        _labels.pop(next(iter(_labels)), None)


def _driver_level():
    """The driver's TROUPE_LOG_LEVEL (which init() sets to warning) as a
    name in _LEVELS, or None when it is none of them."""
    import os

    want = os.environ.get("TROUPE_LOG_LEVEL", "info").lower()
    want = {"warn": "warning", "err": "error"}.get(want, want)
    return want if want in _LEVELS else None


def _below_driver_level(line, want):
    """Whether `line` is the runtime's own log line at a level below `want`
    (_driver_level(), read once per batch of lines): the worker's file holds
    its node's level, so "reconnected to the head" at info reached a console
    set to warnings. What the program printed is kept."""
    m = _RUNTIME_LINE.match(line)
    if not m or want is None:
        return False
    level = {"warn": "warning", "err": "error"}.get(m.group(1), m.group(1))
    if level not in _LEVELS:
        return False
    return _LEVELS.index(level) < _LEVELS.index(want)


class _Followed:
    """One actor's worker file: where the next read starts, and the line it
    has begun."""

    def __init__(self, label):
        self.label = label
        self.path = None
        self.offset = 0
        self.partial = b""
        self.pid = "?"


class DriverLogs:
    def __init__(self, client, out=None):
        self._client = client
        self._me = client.client_id
        self._out = out  # None: sys.stdout as it is at each print
        self._followed = {}  # actor id -> _Followed
        self._no_files = set()  # actors on nodes that keep no worker files: not asked again
        self._ended = {}  # dead actors whose files were read to the end (insertion-ordered)
        self._resting = {}  # actor id -> _Followed: not alive (restarting?), its file read to the end
        self._looks = 0
        self._lock = threading.Lock()  # one look at a time (the thread's, close()'s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="troupe-driver-logs", daemon=True)
        self._thread.start()

    def close(self):
        """Stops following, after one last look (bounded; before the client
        goes)."""
        deadline = time.monotonic() + CLOSE_BOUND_S
        self._stop.set()
        self._thread.join(timeout=CLOSE_BOUND_S)
        try:
            self.poll(deadline)
        except Exception:  # noqa: BLE001 - the cluster may be gone already
            pass
        with self._lock:
            for f in self._followed.values():
                self._flush(f, final=True)
            self._followed.clear()

    def _run(self):
        failures, said = 0, False
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
                failures = 0
            except Exception as e:  # noqa: BLE001 - the head away for a moment, or the client closing
                # Said once, when it lasts (a head of another version, say),
                # not for a blip.
                failures += 1
                if failures >= FAILURES_SAID and not said and not self._stop.is_set():
                    said = True
                    print(f"troupe: log_to_driver cannot follow the workers' logs ({type(e).__name__}: {e}); "
                          "still trying (troupe logs ACTOR reads one)", file=sys.stderr, flush=True)

    def poll(self, deadline=None):
        with self._lock:
            # The head picks this driver's actors (its status names each
            # actor's driver). The dead first: death is final, so an actor
            # that dies between the two requests is not in both lists.
            self._looks += 1
            dead = []
            if deadline is not None or self._looks % DEAD_EVERY == 0:
                dead = json.loads(self._client.status_json(state="DEAD", driver=self._me,
                                                           limit=DEAD_LOOKED_AT)).get("actors", [])
            alive = json.loads(self._client.status_json(state="ALIVE", driver=self._me)).get("actors", [])
            mine = {a["id"]: a for a in alive if a.get("driver") == self._me}
            # No longer alive: read to the end of its last worker's file
            # (kept: a restart goes on from there).
            for actor in [a for a in self._followed if a not in mine]:
                f = self._resting[actor] = self._followed.pop(actor)
                f.label = _labels.get(actor, f.label)  # named since the last look, gone before this one
                self._read_to_end(actor, f, deadline)
            # Dead before any look saw it alive: its file, whole, once.
            for a in dead:
                if self._resting.pop(a["id"], None) is not None:
                    self._remember_ended(a["id"])
                if a.get("driver") != self._me or a["id"] in self._ended or a["id"] in self._no_files:
                    continue
                if deadline is not None and time.monotonic() > deadline:
                    return
                self._remember_ended(a["id"])
                self._read_to_end(a["id"], _Followed(self._label(a)), deadline)
            while len(self._resting) > RESTING_KEPT:  # rows the head evicted before they were seen dead
                del self._resting[next(iter(self._resting))]
            for actor, a in mine.items():
                if deadline is not None and time.monotonic() > deadline:
                    return
                if actor in self._no_files:
                    continue
                f = self._followed.get(actor)
                if f is None and actor in self._resting:
                    f = self._followed[actor] = self._resting.pop(actor)
                restarted_unseen = f is None and a.get("restarts", 0) > 0
                if f is None:
                    f = self._followed[actor] = _Followed(self._label(a))
                f.label = self._label(a)  # label_actor may have named it since
                try:
                    if restarted_unseen or (f.path is not None and str(a["pid"]) != f.pid):
                        # It restarted between two looks: the rest of its
                        # last worker's file first, then the new one's.
                        self._read(actor, f, deadline, previous=True)
                        self._flush(f, final=True)
                        f.path, f.offset = None, 0
                    self._read(actor, f, deadline)
                except Exception as e:  # noqa: BLE001 - the runtime's error for this actor
                    if "keeps no worker log files" in str(e):
                        del self._followed[actor]
                        self._no_files.add(actor)
                    continue

    def _remember_ended(self, actor):
        self._ended[actor] = None
        while len(self._ended) > ENDED_KEPT:
            del self._ended[next(iter(self._ended))]

    @staticmethod
    def _label(a):
        label = _labels.get(a["id"])  # one read: label_actor may change the dict meanwhile
        if label is not None:
            return label
        return "task" if a["class"] == _EXECUTOR_CLASS else a["class"].rsplit(".", 1)[-1]

    def _read_to_end(self, actor, f, deadline):
        """The rest of a no longer alive actor's last worker's file."""
        try:
            self._read(actor, f, deadline)
        except Exception:  # noqa: BLE001 - its node gone, say: what was read is all there is
            pass
        self._flush(f, final=True)

    def _read(self, actor, f, deadline, previous=False):
        """Reads what `f`'s file gained, to its end (or the deadline); with
        `previous`, from the actor's worker before its current one, when
        that is still `f`'s file."""
        while deadline is None or time.monotonic() < deadline:
            text, next_offset, size, path = self._client.read_actor_log(actor, f.offset, CHUNK_BYTES,
                                                                        READ_TIMEOUT_S, previous)
            if previous and f.path is not None and path != f.path:
                return  # restarted more than once since the last look: that file is lost to it
            if path != f.path or size < f.offset:
                # Another worker's file (the first look, or a restart), or
                # the same path begun again (a pid used again): from its start.
                self._flush(f, final=True)
                first = f.path is None and f.offset == 0
                f.path, f.offset, f.partial = path, 0, b""
                m = _WORKER_FILE.search(path)
                f.pid = m.group(1) if m else "?"
                if not first:
                    continue
            f.offset = next_offset
            f.partial += text
            self._flush(f)
            if next_offset >= size or not text:
                return
            if deadline is None and self._stop.is_set():
                return  # close() takes over

    def _flush(self, f, final=False):
        """Prints `f`'s whole lines (and, when final, the rest)."""
        lines = f.partial.split(b"\n")
        f.partial = lines.pop()
        if final and f.partial:
            lines.append(f.partial)
            f.partial = b""
        if not lines:
            return
        want = _driver_level()
        text = [t for t in (line.decode("utf-8", "replace") for line in lines) if not _below_driver_level(t, want)]
        if not text:
            return
        out = self._out or sys.stdout
        prefix = f"({f.label} pid={f.pid}) "
        out.write("".join(prefix + t + "\n" for t in text))
        out.flush()
