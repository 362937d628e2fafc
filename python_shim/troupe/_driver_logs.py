"""What the driver's tasks and actors print, on the driver's console (Ray's
log_to_driver).

On an embedded cluster the workers share the driver's output already. On a
cluster started with `troupe start`, each worker writes to a file of its
own beside its node agent's log (docs/runtime.md, "Logs"), which is where
a print() in a task used to stay. A driver connected to such a cluster
follows those files: a thread asks the head now and then for the actors
whose work is this driver's (the head's status names each actor's driver,
following owners through the actors that started them) and reads what
their workers' files gained since the last look, through the same
requests as `troupe logs`. Each line is printed with its worker's class and
pid, as Ray does: `(Counter pid=4242) hello`, `(task pid=4243) ...` for a
task's worker.

An actor that ended is read once more and then dropped; troupe.shutdown()
reads everything once more before it disconnects, so a task's last lines
are not lost when the script ends right after it."""
import json
import re
import sys
import threading

# How often the files are looked at.
POLL_S = 0.25
# The most read from one file in one request.
CHUNK_BYTES = 256 << 10
_EXECUTOR_CLASS = "TaskExecutor"  # runtime/client/task.h
_WORKER_FILE = re.compile(r"worker-(\d+)\.log$")


class _Followed:
    """One actor's worker file: where the next read starts, and the line it
    has begun."""

    def __init__(self, label):
        self.label = label
        self.path = None
        self.offset = 0
        self.partial = b""
        self.pid = None


class DriverLogs:
    def __init__(self, client, out=None):
        self._client = client
        self._me = client.client_id
        self._out = out  # None: sys.stdout as it is at each print
        self._followed = {}  # actor id -> _Followed
        self._ignored = set()  # actors whose node keeps no files, or that ended and were read
        self._lock = threading.Lock()  # one poll at a time (the thread's, shutdown's last)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="troupe-driver-logs", daemon=True)
        self._thread.start()

    def close(self):
        """Stops following, after one last look (before the client goes)."""
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self.poll()
        except Exception:  # noqa: BLE001 - the cluster may be gone already
            pass
        for f in self._followed.values():
            self._flush(f, final=True)

    def _run(self):
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the head away for a moment, or the client closing
                continue

    def poll(self):
        with self._lock:
            actors = json.loads(self._client.status_json()).get("actors", [])
            for a in actors:
                actor = a["id"]
                if a.get("driver") != self._me or actor in self._ignored:
                    continue
                followed = self._followed.get(actor)
                if followed is None:
                    if a["state"] != "ALIVE" and a["state"] != "DEAD":
                        continue  # no worker yet
                    label = "task" if a["class"] == _EXECUTOR_CLASS else a["class"].rsplit(".", 1)[-1]
                    followed = self._followed[actor] = _Followed(label)
                try:
                    if not self._read(actor, followed):
                        continue
                except Exception:  # noqa: BLE001 - its node gone, say: a dead one is not read again
                    if a["state"] == "DEAD":
                        self._followed.pop(actor, None)
                        self._ignored.add(actor)
                    continue
                if a["state"] == "DEAD":
                    self._flush(followed, final=True)
                    del self._followed[actor]
                    self._ignored.add(actor)

    def _read(self, actor, f):
        """Reads what `f`'s file gained; False when the actor has no file to
        read (its node keeps none: it is not followed again)."""
        for _ in range(64):  # a bounded catch-up per look
            try:
                text, next_offset, size, path = self._client.read_actor_log(actor, f.offset, CHUNK_BYTES)
            except Exception as e:  # noqa: BLE001 - the runtime's ConfigError, or the head away
                if "keeps no worker log files" in str(e) or "has had no worker process" in str(e):
                    if "keeps no worker log files" in str(e):
                        self._ignored.add(actor)
                        self._followed.pop(actor, None)
                    return False
                raise
            if path != f.path:
                # Another worker (a restart), or the first look: from its start.
                self._flush(f, final=True)
                known = f.path is not None
                f.path, f.offset, f.partial = path, 0, b""
                m = _WORKER_FILE.search(path)
                f.pid = m.group(1) if m else "?"
                if known or next_offset != len(text):
                    continue
            f.offset = next_offset
            f.partial += text
            self._flush(f)
            if next_offset >= size:
                return True
        return True

    def _flush(self, f, final=False):
        """Prints `f`'s whole lines (and, when final, the rest)."""
        lines = f.partial.split(b"\n")
        f.partial = lines.pop()
        if final and f.partial:
            lines.append(f.partial)
            f.partial = b""
        if not lines:
            return
        out = self._out or sys.stdout
        prefix = f"({f.label} pid={f.pid}) "
        out.write("".join(prefix + line.decode("utf-8", "replace") + "\n" for line in lines))
        out.flush()
