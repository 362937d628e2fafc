"""Checkpoints: `Checkpoint` (a directory, as Ray Train's) and
`CheckpointStore`, which persists the ones rank 0 reports under a run's
folder atomically and keeps K of them.

A persisted checkpoint is `<run>/checkpoint_NNNNNN/`: copied into a hidden
temporary folder, every file and folder fsynced, then renamed into place, so
a crash at any point leaves either the whole checkpoint or none (a leftover
temporary folder is swept at the next start). Each report of rank 0 is one
line of `<run>/progress.jsonl` (metrics, checkpoint name), which is how the
driver learns the metrics and how keep-K ranks checkpoints by score.
Metrics that are tensors or NumPy values are stored as Python numbers (or
lists), so that they read back as numbers and rank as numbers.
"""

import contextlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import uuid

from .config import _URI

_NAME = re.compile(r"^checkpoint_(\d{6,})$")
_TMP_PREFIX = ".tmp_checkpoint_"
_PART_PREFIX = ".part_"  # another rank's files of a report, staged for rank 0
PROGRESS = "progress.jsonl"


def _progress_lines(run_dir):
    """The reports of the run whose folder is `run_dir` ([] without a
    progress file; a line cut short by a crash is skipped)."""
    path = os.path.join(run_dir, PROGRESS)
    if not os.path.exists(path):
        return []
    lines = []
    with open(path) as f:
        for line in f:
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
    return lines
METADATA = ".metadata.json"  # a checkpoint's metadata (Checkpoint.set_metadata), as Ray names it


def _plain(value):
    """`value` as JSON stores it faithfully: a tensor or NumPy value of one
    element as its Python number (a 0-d `correct / n` is a tensor), a larger
    one as a (nested) list, inside dicts, lists and tuples too. Anything
    else is left as it is."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, bytes, bool, int, float)):
        return value
    # torch.Tensor and NumPy's scalars and arrays all have item() and
    # tolist(); a tensor counts its elements with numel(), NumPy with size.
    if callable(getattr(value, "item", None)) and callable(getattr(value, "tolist", None)):
        numel = getattr(value, "numel", None)
        size = numel() if callable(numel) else getattr(value, "size", None)
        try:
            return value.item() if size == 1 else value.tolist()
        except Exception:  # an object that only looks like one: stored as before
            return value
    return value


def _json_leaf(value):
    """Whether json.dumps stores `value` (after _plain) as itself."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if isinstance(value, list):
        return all(isinstance(v, dict) or _json_leaf(v) for v in value)
    return False


def _number(value):
    """`value` when it ranks as a score (an int or float, not NaN), else None."""
    if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
        return value
    return None


def _lookup(metrics, attr):
    """metrics[attr], or, for "a/b", metrics["a"]["b"] (Ray's flattened
    names); None when missing."""
    if not isinstance(metrics, dict):
        return None
    if attr in metrics:
        return metrics[attr]
    value = metrics
    for part in attr.split("/"):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


class Checkpoint:
    """A checkpoint is a directory of files the training loop wrote."""

    def __init__(self, path):
        # Absolute here: a relative path was resolved in each worker's own
        # working directory, which need not be the driver's.
        path = os.fsdecode(os.fspath(path))
        self.path = path if _URI.match(path) else os.path.abspath(os.path.expanduser(path))

    @classmethod
    def from_directory(cls, path):
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ValueError(f"Checkpoint.from_directory: {path!r} is not a directory")
        return cls(os.path.abspath(path))

    def to_directory(self, path=None):
        """Copies the checkpoint into `path` (a new temporary folder if None)."""
        path = os.fspath(path) if path is not None else tempfile.mkdtemp(prefix="troupe_checkpoint_")
        shutil.copytree(self.path, path, dirs_exist_ok=True)
        return path

    @contextlib.contextmanager
    def as_directory(self):
        """The checkpoint's files, read in place (no copy)."""
        yield self.path

    def get_metadata(self):
        """The checkpoint's metadata (a dict, {} if none was set), kept in
        its folder as .metadata.json, as Ray's."""
        path = os.path.join(self.path, METADATA)
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            return json.load(f)

    def set_metadata(self, metadata):
        """Replaces the checkpoint's metadata with `metadata` (a dict of
        JSON values; tensors and NumPy values are stored as numbers)."""
        if not isinstance(metadata, dict):
            raise TypeError(f"Checkpoint.set_metadata: metadata must be a dict, got {type(metadata).__name__}")
        text = json.dumps(_plain(metadata))  # before the file is touched: a bad value changes nothing
        tmp = os.path.join(self.path, f"{METADATA}.{uuid.uuid4().hex[:8]}")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(self.path, METADATA))

    def update_metadata(self, metadata):
        """Merges `metadata` (a dict) into the checkpoint's metadata."""
        if not isinstance(metadata, dict):
            raise TypeError(f"Checkpoint.update_metadata: metadata must be a dict, got {type(metadata).__name__}")
        self.set_metadata({**self.get_metadata(), **metadata})

    def __repr__(self):
        return f"Checkpoint(path={self.path!r})"

    def __eq__(self, other):
        return isinstance(other, Checkpoint) and other.path == self.path

    def __hash__(self):
        return hash(self.path)


def _fsync_tree(root):
    for folder, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(folder, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(folder)


def _fsync_dir(folder):
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_MARKER = ".validate_storage_marker_"


class StorageNotSharedError(RuntimeError):
    """Rank 0 cannot see the checkpoint files another rank staged: the run
    folder is not on storage every node shares. Another attempt would
    meet it again, so it fails the run at once."""


def _move_unless_there(src, dst):
    """copytree's copy for merging ranks' staged files (on the same file
    system: moved, not copied): the first file of a name stays (rank 0's,
    then the lowest rank's)."""
    if not os.path.exists(dst):
        try:
            os.rename(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    return dst


class CheckpointStore:
    """The persisted checkpoints and progress of one run folder. Only rank 0
    writes (one writer); the driver reads between attempts."""

    def __init__(self, run_dir, checkpoint_config):
        self.run_dir = os.fspath(run_dir)
        self.config = checkpoint_config
        self._warned_unranked = False
        self._warned_repr = set()  # metric names already said to be stored as their repr

    def sweep(self):
        """Creates the run folder; removes temporary folders a crash left;
        writes a new marker (marker_token), by which rank 0 checks that it
        sees the folder the driver made."""
        os.makedirs(self.run_dir, exist_ok=True)
        for entry in os.listdir(self.run_dir):
            if entry.startswith((_TMP_PREFIX, ".deleting_", _PART_PREFIX)):
                shutil.rmtree(os.path.join(self.run_dir, entry), ignore_errors=True)
        self.remove_marker()
        # A file of its own each attempt (a cached directory entry of an
        # earlier attempt's on a network file system cannot pass for it).
        self.marker_token = uuid.uuid4().hex
        with open(os.path.join(self.run_dir, _MARKER + self.marker_token), "w") as f:
            f.write(self.marker_token)

    def remove_marker(self):
        """Removes this store's markers (every attempt's)."""
        try:
            entries = os.listdir(self.run_dir)
        except OSError:
            return
        for entry in entries:
            if entry.startswith(_MARKER.rstrip("_")):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(self.run_dir, entry))

    def check_shared(self, token, rank):
        """Raises StorageNotSharedError unless this process sees the marker
        the driver wrote with `token` (rank 0 writes the run's progress and
        checkpoints into the folder: on a node that does not share it they
        went to that node's disk, and the run ended as a success without
        them)."""
        try:
            with open(os.path.join(self.run_dir, _MARKER + token)) as f:
                seen = f.read()
        except OSError:
            seen = None
        if seen != token:
            import socket

            raise StorageNotSharedError(
                f"TorchTrainer: rank {rank} on {socket.gethostname()} does not see the run folder {self.run_dir} "
                f"that the driver made: rank 0 writes the run's progress and checkpoints there, so give "
                "RunConfig(storage_path=...) a folder every node shares")

    def indices(self):
        """Indices of the complete checkpoints, oldest first."""
        if not os.path.isdir(self.run_dir):
            return []
        # A folder each: a stray file of a checkpoint's name is none.
        return sorted(int(m.group(1)) for name in os.listdir(self.run_dir)
                      if (m := _NAME.match(name)) and os.path.isdir(os.path.join(self.run_dir, name)))

    def path_of(self, index):
        return os.path.join(self.run_dir, f"checkpoint_{index:06d}")

    def latest(self):
        found = self.indices()
        return Checkpoint(self.path_of(found[-1])) if found else None

    def part_path(self, iteration, rank):
        return os.path.join(self.run_dir, f"{_PART_PREFIX}{iteration:06d}_rank{rank}")

    def stage_part(self, iteration, rank, source_dir):
        """Another rank's files of report `iteration`, copied whole (to a
        temporary name first) where persist() takes them in."""
        final = self.part_path(iteration, rank)
        tmp = f"{final}.{uuid.uuid4().hex[:8]}"
        shutil.copytree(source_dir, tmp)
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.rename(tmp, final)

    def persist(self, source_dir, metrics, extra=None, parts=()):
        """Copies `source_dir` (None: no files of its own) in as the next
        checkpoint with the files of `parts` ((rank, staged folder), each
        taken and removed; `source_dir`'s win where names clash),
        atomically; records the report and applies keep-K. Returns the new
        Checkpoint."""
        found = self.indices()
        index = found[-1] + 1 if found else 0
        tmp = os.path.join(self.run_dir, f"{_TMP_PREFIX}{index:06d}_{uuid.uuid4().hex[:8]}")
        if source_dir is not None:
            shutil.copytree(source_dir, tmp)
        else:
            os.makedirs(tmp)
        for rank, part in parts:
            if not os.path.isdir(part):
                raise StorageNotSharedError(f"troupe.train.report: rank {rank} reported a checkpoint, but its files "
                                            f"are not at {part}: give RunConfig(storage_path=...) a folder every "
                                            "node shares")
            shutil.copytree(part, tmp, dirs_exist_ok=True, copy_function=_move_unless_there)
            shutil.rmtree(part, ignore_errors=True)
        _fsync_tree(tmp)
        final = self.path_of(index)
        # The report first: a rank killed between the two left a checkpoint
        # without its line, and the restart resumed from it with no
        # iteration count and no loader epochs (its data order started
        # again). Killed now, a line names a checkpoint that never came,
        # which the next persist() takes the index of (the latest line of a
        # name is its report).
        self.record(metrics, os.path.basename(final), extra)
        os.rename(tmp, final)
        _fsync_dir(self.run_dir)
        self._warn_if_unranked(os.path.basename(final), metrics)
        self._keep()
        return Checkpoint(final)

    def _warn_if_not_json(self, metrics, prefix=""):
        """Says once per metric name that a value JSON cannot hold (a
        datetime, a custom object) is stored as its repr: Result.metrics
        and the progress file then hold a string, not the object."""
        for key, value in metrics.items() if isinstance(metrics, dict) else ():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                self._warn_if_not_json(value, f"{name}/")
            elif not _json_leaf(value) and name not in self._warned_repr:
                self._warned_repr.add(name)
                print(f"troupe.train.report: metric {name!r} is a {type(value).__name__}, which JSON cannot hold; "
                      f"it is stored as its repr {repr(value)[:80]!r}. Report numbers, strings, lists or dicts",
                      file=sys.stderr, flush=True)

    def _warn_if_unranked(self, name, metrics):
        """Says once per attempt that a checkpoint's score is no number: it
        ranks last, which is easy to miss when the metric is misspelt."""
        attr = self.config.checkpoint_score_attribute
        if attr is None or self._warned_unranked:
            return
        value = _lookup(_plain(metrics), attr)
        if _number(value) is None:
            self._warned_unranked = True
            what = "has no" if value is None else f"has {value!r}, not a number, as"
            print(f"troupe.train: {name} {what} checkpoint_score_attribute={attr!r}; it ranks below every "
                  "checkpoint with a number", file=sys.stderr, flush=True)

    def report_of(self, checkpoint_path):
        """The report that persisted `checkpoint_path`: for a checkpoint of
        this run its metrics, iteration and loader epochs; for another run's
        (resume_from_checkpoint) only its loader epochs, read from that
        run's progress file beside it (this run counts its own
        iterations); {} for a folder no run made."""
        run_dir = os.path.dirname(os.path.abspath(checkpoint_path))
        ours = run_dir == os.path.abspath(self.run_dir)
        name = os.path.basename(os.path.abspath(checkpoint_path))
        for line in reversed(self.progress() if ours else _progress_lines(run_dir)):
            if line.get("checkpoint") == name:
                if ours:
                    return line
                # The loaders resume where that run's were: resumed from epoch
                # 0's order instead, a new run repeated it (probe 12b).
                return {"loader_epochs": line["loader_epochs"]} if line.get("loader_epochs") else {}
        return {}

    def record(self, metrics, checkpoint_name=None, extra=None):
        plain = _plain(metrics)
        self._warn_if_not_json(plain)
        line = {"metrics": plain, "checkpoint": checkpoint_name, "time": time.time(), **(extra or {})}
        with open(os.path.join(self.run_dir, PROGRESS), "a") as f:
            f.write(json.dumps(line, default=repr) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def progress(self):
        """Every report rank 0 made, in order (across restarts)."""
        return _progress_lines(self.run_dir)

    def _keep(self):
        """Keeps the `num_to_keep` best (the newest, without a score
        attribute) and the latest, as Ray Train does: the latest is what a
        restart resumes from, whatever its score."""
        keep = self.config.num_to_keep
        found = self.indices()
        if keep is None or len(found) <= keep:
            return
        kept = set(self._ranked(found)[:keep]) | {found[-1]}
        for index in found:
            if index in kept:
                continue
            # Renamed before removal, so a half-removed folder never reads
            # as a checkpoint.
            doomed = os.path.join(self.run_dir, f".deleting_{index:06d}_{uuid.uuid4().hex[:8]}")
            os.rename(self.path_of(index), doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def _metrics_by_index(self):
        by_index = {}
        for line in self.progress():
            m = _NAME.match(line.get("checkpoint") or "")
            if m:
                by_index[int(m.group(1))] = line.get("metrics") or {}
        return by_index

    def _ranked(self, indices):
        """Indices best first: newest first, or by the score attribute.
        Scores compare as numbers only: a checkpoint whose score is missing,
        not a number or NaN ranks below every one with a number (in either
        order), newest first among them. Of equal scores the newer wins."""
        attr = self.config.checkpoint_score_attribute
        if attr is None:
            return sorted(indices, reverse=True)
        metrics = self._metrics_by_index()
        score = {i: _number(_lookup(metrics.get(i), attr)) for i in indices}
        sign = 1 if self.config.checkpoint_score_order == "max" else -1
        scored = sorted((i for i in indices if score[i] is not None), key=lambda i: (sign * score[i], i), reverse=True)
        return scored + sorted((i for i in indices if score[i] is None), reverse=True)

    def best_checkpoints(self):
        """(Checkpoint, metrics) of the kept checkpoints, ordered as Ray's
        Result.best_checkpoints: oldest first; with a score attribute, the
        `num_to_keep` best from the worst to the best (the best last),
        leaving out the latest when only its being the latest kept it."""
        found = self.indices()
        metrics = self._metrics_by_index()
        if self.config.checkpoint_score_attribute is None:
            order = found
        else:
            order = self._ranked(found)[:self.config.num_to_keep][::-1]
        return [(Checkpoint(self.path_of(i)), metrics.get(i, {})) for i in order]
