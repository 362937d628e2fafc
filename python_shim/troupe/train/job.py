"""troupe.train.TrainJob: the C++ TrainJob from Python.

The C++ TrainJob (heal from a live peer, bitwise-equal recovery,
exactly-once data across failures; see "Which samples an epoch trains")
runs the training; this class only hands it a job: the
model as a TorchScript step module (a torch.nn.Module is scripted here), the
data as .npz arrays (NumPy arrays or tensors are saved here), and the
TrainJobConfig fields, then runs `troupe-train` (the driver of `troupe
train`) on them and reads its metrics back as Python objects.

    job = TrainJob(Step(), {"features": x, "value": y}, workers=2, epochs=3,
                   batch_size=32, optimizer="adamw", lr=1e-3, max_failures=2)
    result = job.fit()
    result.history[-1]["loss"], result.recoveries, result.state_dict()

The step module's forward(batch: Dict[str, Tensor]) returns a dict with
"loss" and any metrics (docs/open_trainer.md). Without `address`, the job
runs on this process's cluster when troupe.init() was called, else on an
embedded cluster of its own. Bad input (a step without "loss", a batch key
the module does not read, a bad option) raises ConfigError naming it before
training starts; a run that fails (more failures than max_failures) raises
TrainingFailedError with the C++ driver's reason. Data given as arrays is
checked here (a ragged or non-numeric array is a ConfigError naming its
key), and the driver's messages are told in this class's terms: `data`,
`data['x']`, `workers=2`, `batch_size=64`, not the driver's flags or the
temporary files this class saved.

Which samples an epoch trains: as torch's DistributedSampler with
drop_last=False feeding loaders with drop_last=True. Each epoch shuffles
the N samples (torch.randperm seeded with seed + epoch), pads that order
by wrap-around to a multiple of `workers`, and deals it out: worker r
takes positions r, r + workers, ... Every step, each worker trains one
whole batch of batch_size; a last batch shorter than batch_size is not
trained. So an epoch is steps = ceil(N / workers) // batch_size steps, it
trains the first steps * workers * batch_size positions of its order, and
the last N - steps * workers * batch_size samples of that order are
skipped in that epoch (none when that is 0 or less; the padding then
repeats the first few). The next epoch's order is another, so another few
are skipped; over epochs each sample is trained about as often. With N =
21, workers=2 and batch_size=4, each epoch trains 16 and skips 5. Choose
batch_size and workers so that workers * batch_size divides N to skip
none. "Exactly once" means a failure, heal, resize or resume (with the
same seed and data) trains each of the epoch's trained positions once:
none is lost or repeated.
"""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from troupe import _timeouts
from troupe.exceptions import ConfigError
from troupe.train.trainer import TrainingFailedError

# The TrainJobConfig fields troupe-train takes (its --config keys), with
# their Python types.
_FIELDS = {
    "workers": int, "min_workers": int, "max_workers": int, "epochs": int, "max_steps": int, "batch_size": int, "accumulation": int, "optimizer": str, "lr": float, "weight_decay": float, "momentum": float,
    "warmup_steps": int, "grad_clip": float, "max_failures": int, "seed": int, "sync_batchnorm": bool,
    "cpus_per_worker": float, "log_every": int, "name": str, "model_options": dict,
    "block_size": int, "token_dtype": str, "schedule": str, "min_lr_factor": float, "compression": str,
    "gpus_per_worker": float, "amp": str, "loader_threads": int, "step_timeout": float, "resume": bool,
    "replacement_timeout": float, "keep_checkpoints": int,
    "cpu_gemm": str, "checkpoint_every": int, "ship_files": bool,
}


def _train_binary():
    from troupe._cli import find_binary

    try:
        return find_binary("troupe-train", "TROUPE_TRAIN")
    except FileNotFoundError as e:
        raise ConfigError(f"TrainJob needs troupe-train, the LibTorch driver of `troupe train` (built with "
                          f"TROUPE_WITH_TORCH=ON): {e}") from None


def _data_keys(data):
    """The batch keys of `data` ({key: array} or an .npz path), or None when
    they cannot be known here (a token stream's are input and target)."""
    if isinstance(data, dict):
        return set(data)
    if isinstance(data, str) and data.endswith(".npz") and os.path.exists(data):
        import numpy as np

        try:
            with np.load(data, allow_pickle=False) as archive:
                return set(archive.files)
        except Exception:  # noqa: BLE001 - troupe-train says what is wrong with it
            return None
    return None


def _save_model(model, work, keys=None):
    if isinstance(model, str):
        if model in ("mlp", "cnn"):
            return model
        if os.path.exists(model):
            # Absolute: troupe-train reads a job file's relative paths from
            # the job file's folder (this TrainJob's temporary one).
            return os.path.abspath(model)
        raise ConfigError(f"model file {model} does not exist")
    import torch

    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, a TorchScript file or a built-in name, "
                          f"got a {type(model).__name__}")
    scripted = model if isinstance(model, torch.jit.ScriptModule) else _script(model, torch)
    _check_step_signature(scripted, type(model).__name__, keys)
    path = os.path.join(work, "step.pt")
    torch.jit.save(scripted, path)
    return path


def _script(model, torch):
    """torch.jit.script(model), or a ConfigError that says why TrainJob
    needs it and what to do instead (torch's own error is pages long)."""
    try:
        return torch.jit.script(model)
    except Exception as e:  # torch raises RuntimeError, OSError, NotSupportedError, ...
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        where = next((line.strip() for line in lines if line.strip().startswith("File ")), "")
        reason = lines[0].strip() if lines else type(e).__name__
        if where:
            reason += f" ({where})"
        raise ConfigError(
            f"TrainJob's model {type(model).__name__} cannot be compiled with torch.jit.script: {reason}. "
            f"TrainJob trains in troupe-train (LibTorch, no Python), so its forward must be TorchScript: "
            f"{_STEP_SIGNATURE}. A model that needs Python trains with troupe.train.TorchTrainer instead") from None


_STEP_SIGNATURE = "forward(self, batch: Dict[str, Tensor]) -> Dict[str, Tensor], returning the 'loss' and any metrics"


def _check_step_signature(scripted, name, keys=None):
    """A step module, or (as `troupe train` takes it) a network forward(x) -> y
    over data with 'input' and 'target' arrays, trained with cross-entropy
    (the `classification` step). Anything else is refused here, naming what
    TrainJob needs, rather than by troupe-train as a batch without an
    'input' key."""
    try:
        schema = scripted.forward.schema
    except Exception:  # noqa: BLE001 - no forward, or a torch without schemas: troupe-train will say
        return
    args = [a for a in schema.arguments[1:] if not a.has_default_value()]
    takes = ", ".join(f"{a.name}: {a.type}" for a in args)
    returns = ", ".join(str(r.type) for r in schema.returns) or "None"
    if len(args) == 1 and str(args[0].type) == "Dict[str, Tensor]" and returns == "Dict[str, Tensor]":
        return
    network = len(args) == 1 and str(args[0].type) == "Tensor" and returns == "Tensor"
    if network and (keys is None or {"input", "target"} <= keys):
        return
    have = "" if keys is None else f" (the data's keys: {', '.join(sorted(keys))})"
    raise ConfigError(
        f"TrainJob's model {name} has forward({takes}) -> {returns}; TrainJob needs a step module, "
        f"{_STEP_SIGNATURE}: the batch holds the data's arrays under their keys, so wrap the network in a module "
        f"whose forward computes the loss from them; or a network forward(x: Tensor) -> Tensor with data whose "
        f"arrays are 'input' and 'target', trained with cross-entropy{have}")


# What troupe-train's .npz reader loads (NumPy kind, item size): the types
# LibTorch has.
_LOADABLE = {("b", 1): "bool", ("i", 1): "int8", ("u", 1): "uint8", ("i", 2): "int16", ("i", 4): "int32",
             ("i", 8): "int64", ("f", 2): "float16", ("f", 4): "float32", ("f", 8): "float64",
             ("c", 8): "complex64", ("c", 16): "complex128"}


def _sample_shapes(value, np):
    """The first samples (value's first-level elements) of each differing
    shape, up to three: {"shape (1,)": 0, "shape (2,)": 1}."""
    seen = {}
    try:
        for i, sample in enumerate(value):
            try:
                shape = f"shape {np.shape(sample)}"
            except ValueError:  # ragged inside the sample too
                shape = "a ragged shape of its own"
            seen.setdefault(shape, i)
            if len(seen) == 3:
                break
    except TypeError:  # not iterable
        pass
    return seen


def _as_array(value, name, np):
    """value as a C-order little-endian array troupe-train loads, or a
    ConfigError naming it (name: data['x'])."""
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()

    def ragged(shapes):
        detail = ", ".join(f"sample {i} has {shape}" for shape, i in shapes.items()) or "they differ"
        return ConfigError(f"{name} is ragged: every sample needs the same shape, but {detail} (pad or crop "
                           f"them to one shape)")

    try:
        array = np.asarray(value)
    except ValueError:  # NumPy >= 1.24: "setting an array element with a sequence ..."
        raise ragged(_sample_shapes(value, np)) from None
    if array.ndim == 0:
        raise ConfigError(f"{name} is a single value (0-dimensional): every array needs a first dimension of one "
                          f"entry per sample")
    array = np.ascontiguousarray(array)
    kind, size = array.dtype.kind, array.dtype.itemsize
    if kind == "O":
        shapes = _sample_shapes(array, np) if array.ndim == 1 else {}
        if len(shapes) > 1:  # an older NumPy made an object array of the ragged samples
            raise ragged(shapes)
        what = "Python objects: None, strings or mixed types"
    elif (kind, size) in _LOADABLE:
        return array.astype(array.dtype.newbyteorder("<"), copy=False)  # big-endian: as little-endian
    elif kind == "u":
        what = f"unsigned {8 * size}-bit integers, which LibTorch lacks: convert them to a signed type"
    elif kind in "US":
        what = "strings"
    else:
        what = "not a numeric type"
    raise ConfigError(f"{name} has dtype {array.dtype} ({what}); TrainJob's data takes "
                      f"{', '.join(_LOADABLE.values())} (e.g. np.asarray(..., dtype=np.float32))")


def _save_data(data, work, stem):
    if isinstance(data, str):
        if not os.path.exists(data):
            raise ConfigError(f"{stem} file {data} does not exist")
        return os.path.abspath(data)
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{stem} must be a dict of arrays (batch key -> array) or an .npz path, got {data!r:.80}")
    import numpy as np

    arrays = {}
    for key, value in data.items():
        name = f"{stem}[{str(key)!r}]"
        arrays[str(key)] = _as_array(value, name, np)
    sizes = {k: a.shape[0] for k, a in arrays.items()}
    if len(set(sizes.values())) != 1:
        raise ConfigError(f"{stem}: every array needs the same first (sample) dimension, got {sizes}")
    path = os.path.join(work, f"{stem}.npz")
    np.savez(path, **arrays)
    return path


# What troupe-train's messages name, in TrainJob's terms: its flags are the
# TrainJob arguments of the same name (--batch-size 64: batch_size=64).
_ARGUMENTS = set(_FIELDS) | {"data", "val_data", "model", "checkpoint_dir", "address"}
_STRING_FIELDS = "|".join(k.replace("_", "-") for k, kind in _FIELDS.items() if kind is str)
# The values of those string flags troupe-train's messages quote (besides
# the job's own): "--amp bf16", "--optimizer adamw".
_STRING_VALUES = {"sgd", "adamw", "constant", "cosine", "none", "bf16", "fp16", "uint16", "uint32", "int32", "int64",
                  "auto", "onednn", "aten"}


def _argument(flag):
    name = flag.replace("-", "_")
    return name if name in _ARGUMENTS else None


def _python_terms(message, work, config):
    """troupe-train's message as a TrainJob user reads it: the files this
    TrainJob saved in its (by then deleted) work folder named by the
    argument they hold (data['x'], val_data, model), and the CLI flags by
    TrainJob's argument names (workers=2, batch_size), and the job file
    it wrote by the argument that gave the key (model_options['hidden'])."""
    if work:
        # A trainer on a host that does not see the driver's temp folder,
        # where this TrainJob saved what it was given as objects.
        for what, stem, arg in (("the model", "step.pt", "model"), ("the data", "data.npz", "data"),
                                ("the validation data", "val_data.npz", "val_data")):
            message = re.sub(re.escape(f"{what} {os.path.join(work, stem)} is not on ") + r"(\S+), where a trainer "
                             r"runs: .*",
                             lambda m, what=what, arg=arg: (
                                 f"{what}, which TrainJob saved in the driver's temp folder, is not on {m.group(1)}, "
                                 f"where a trainer runs: leave ship_files on (it is on a cluster: address given, or "
                                 f"troupe.init() with one), set "
                                 f"TMPDIR to a folder every node shares, or give {arg} as a file every node shares"),
                             message)
        job_file = f"job file {os.path.join(work, 'job.json')}: "
        saved = {"data": os.path.join(work, "data.npz"), "val_data": os.path.join(work, "val_data.npz"),
                 "model": os.path.join(work, "step.pt")}
        for key, path in saved.items():
            message = message.replace(f"{job_file}key '{key}': {path}", key)
        for key in ("data", "val_data", "model", "checkpoint_dir", "metrics"):
            value = config.get(key)
            if isinstance(value, str) and value:
                message = message.replace(f"{job_file}key '{key}': {value}", f"{key}={value!r}")
        # Numbers and the words of string settings the job file gave:
        # "key 'workers': 2" is workers=2, "key 'amp': fp16" is amp='fp16'.
        message = re.sub(re.escape(job_file) + r"key '(\w+)': (-?\d+(?:\.\d+)?(?:e[-+]?\d+)?)(?![\w.])",
                         r"\1=\2", message)
        message = re.sub(re.escape(job_file) + r"key '(\w+)': ([\w.-]+)",
                         lambda m: (f"{m.group(1)}={m.group(2)!r}" if m.group(2) in _STRING_VALUES
                                    or m.group(2) == config.get(m.group(1)) else m.group(0)), message)
        message = re.sub(re.escape(job_file) + r"key '(\w+)(?:\.([^']+))?'",
                         lambda m: m.group(1) + (f"[{m.group(2)!r}]" if m.group(2) else ""), message)
        message = message.replace(job_file, "")
        for stem in ("data", "val_data"):
            saved = os.path.join(work, f"{stem}.npz")
            message = re.sub(r"npy file '" + re.escape(saved) + r":(.*?)\.npy'",
                             lambda m, stem=stem: f"{stem}[{m.group(1)!r}]", message)
            for form in (f"--{stem.replace('_', '-')} {saved}", f"npz('{saved}')", f"npz file '{saved}'", saved):
                message = message.replace(form, stem)
        message = message.replace(os.path.join(work, "step.pt"), "model")
    # Paths the user gave (and the checkpoint folder): as Python strings.
    for key in ("data", "val_data", "model", "checkpoint_dir"):
        value = config.get(key)
        if isinstance(value, str) and value:
            message = message.replace(f"--{key.replace('_', '-')} {value}", f"{key}={value!r}")
    message = message.replace("the same command with --resume", "a TrainJob with resume=True")
    message = message.replace("the same command goes on", "a TrainJob with resume=True goes on")
    message = re.sub(r"--resume \(resume=True in Python's TrainJob[^)]*\)", "resume=True", message)
    message = message.replace("(troupe train --ship-files)", "(ship_files=True)")
    message = message.replace("troupe train --", "TrainJob --")

    def number(m):
        name = _argument(m.group(1))
        return f"{name}={m.group(2)}" if name else m.group(0)

    message = re.sub(r"--([a-z][a-z0-9-]*) (-?\d+(?:\.\d+)?(?:e[-+]?\d+)?)(?![\w.])", number, message)
    def word(m):
        flag, value = m.group(1), m.group(2)
        if value in _STRING_VALUES or value == config.get(flag.replace("-", "_")):
            return f"{_argument(flag)}={value!r}"
        return m.group(0)

    message = re.sub(r"--(" + _STRING_FIELDS + r") ([\w.-]+)", word, message)
    message = message.replace("--resume", "resume=True")
    return re.sub(r"--([a-z][a-z0-9-]*)", lambda m: _argument(m.group(1)) or m.group(0), message)


def _read_lines(path):
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line being written
    return out


def _killed_message(sig, checkpoint_dir):
    """Why a troupe-train killed by signal `sig` ended, and the newest
    checkpoint it left in `checkpoint_dir` (to resume from)."""
    import signal as signals

    try:
        name = signals.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    newest = None
    try:
        steps = [d for d in os.listdir(checkpoint_dir) if d.startswith("step-")
                 and os.path.exists(os.path.join(checkpoint_dir, d, "manifest.json"))]
        newest = os.path.join(checkpoint_dir, max(steps)) if steps else None
    except OSError:
        pass
    return (f"troupe-train was killed by {name}; "
            + (f"its newest checkpoint is {newest}" if newest else "it left no checkpoint"))


def _reason(output):
    """What the last `troupe train: ` line said, with the lines after it
    (a reason of several lines, such as a model torch could not load)."""
    lines = output.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("troupe train: ")]
    if not starts:
        return ""
    first = lines[starts[-1]][len("troupe train: "):]
    rest = [ln for ln in lines[starts[-1] + 1:] if ln.strip()]
    return "\n".join(([first] if first.strip() else []) + rest).strip()


def _kept(lines, kind):
    """The lines of `kind` ("step" or "epoch") of a run's metrics, less
    those a restore rolled back: a job restored from a checkpoint (or
    started over) forgets what came after the step it restored, runs those
    steps again and logs them again; only the second run is in the
    weights. A job that ends before it ran them again keeps none of them."""
    kept = []
    for j in lines:
        restored = j.get("kind") == "event" and j.get("event") == "restored"
        if restored and isinstance(j.get("step"), int):
            while kept and isinstance(kept[-1].get("step"), int) and kept[-1]["step"] > j["step"]:
                kept.pop()
        if j.get("kind") != kind:
            continue
        step = j.get("step")
        # A step logged again without a restore line (a metrics file of an
        # older version): the later one stands.
        while kind == "step" and kept and isinstance(step, int) and kept[-1].get("step", -1) >= step:
            kept.pop()
        kept.append(j)
    return kept


def _kept_steps(lines):
    return _kept(lines, "step")


_KIND_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "True or False"}


class TrainJobResult:
    """What a TrainJob run left: `history` (one dict per optimizer step:
    step, epoch, loss, the step's metrics, samples_per_s, world_size, time;
    steps a restore from a checkpoint rolled back and ran again are there
    once, as they ran the second time),
    `epochs` (one dict per epoch, likewise once), `events` (placed, failure, healed, ...,
    each with time, step, workers, detail), `recoveries` (failures the job
    survived), `checkpoint` (the final checkpoint's directory: model.pt is a
    {name: tensor} dict for torch.load), `path` (the checkpoint root),
    `metrics` (the last epoch's), `output` (what the driver printed)."""

    def __init__(self, lines, checkpoint, path, output):
        self.history = _kept_steps(lines)
        self.epochs = _kept(lines, "epoch")
        self.events = [j for j in lines if j.get("kind") == "event"]
        # Each failure event of a run that went on is one recovery.
        self.recoveries = sum(1 for e in self.events if e.get("event") == "failure")
        self.checkpoint = checkpoint
        self.path = path
        self.metrics = self.epochs[-1] if self.epochs else {}
        self.output = output

    def state_dict(self):
        """The final weights ({parameter name: tensor}), as torch.load reads them."""
        if not self.checkpoint:
            raise FileNotFoundError("the run wrote no checkpoint")
        import torch

        return torch.load(os.path.join(self.checkpoint, "model.pt"))

    def __repr__(self):
        last = self.history[-1] if self.history else {}
        return (f"TrainJobResult(steps={last.get('step')}, loss={last.get('loss')}, "
                f"recoveries={self.recoveries}, checkpoint={self.checkpoint!r})")


class TrainJob:
    """A C++ TrainJob, configured from Python (see the module's text).

    model: torch.nn.Module (scripted), a TorchScript file, or "mlp"/"cnn".
    data, val_data: {batch key: array} or an .npz path; with block_size, a
    token stream for a language model (a .bin of raw token ids of
    token_dtype, or a 1-d integer .npy) cut into windows of block_size.
    checkpoint_dir: where checkpoints go (default: a new directory under the
    system's temp dir, kept after the run). address: "HOST:PORT", "auto", or
    None (this process's troupe cluster if initialised, else embedded).
    Other keywords: the TrainJobConfig fields of `troupe train` (workers, min_workers, max_workers,
    epochs, max_steps (stop after N optimizer steps in all, or after the epochs,
    whichever comes first; a stop mid-epoch writes a checkpoint), batch_size,
    accumulation (batches each worker adds up before one
    optimizer step), optimizer, lr, weight_decay, warmup_steps, grad_clip,
    max_failures, seed, sync_batchnorm, cpus_per_worker, log_every, checkpoint_every (steps between
    checkpoints inside an epoch; 0: at epoch ends only), name,
    model_options, block_size, token_dtype, schedule ("constant"/"cosine"),
    min_lr_factor, compression ("none"/"bf16"/"fp16"), gpus_per_worker, amp
    ("none"/"bf16"/"fp16": autocast; bf16 on the CPU too, fp16 on GPUs
    only), loader_threads (pipeline threads of each trainer's data
    loader), step_timeout (seconds a trainer may take to answer before it
    counts as hung and is healed), replacement_timeout (seconds a failed
    trainer's replacement may wait for room before the job shrinks or
    fails), keep_checkpoints (the newest N kept; 0 keeps all), cpu_gemm ("auto"/"onednn"/"aten": who
    computes the fp32 linear layers of a CPU trainer), ship_files (send the model and data files from
    this process to the trainers' hosts, each fetched once per host; on by default on a cluster
    (address given, troupe.init() joined one, or TROUPE_ADDRESS names one) when a model or data
    set was given as an object,
    which TrainJob saves in this host's temp folder)). verbose: print the driver's progress lines.

    Each epoch trains ceil(N / workers) // batch_size steps of workers x
    batch_size samples (with accumulation=K, read batch_size x K): the last N - steps * workers * batch_size samples
    of the epoch's shuffled order (a different few each epoch) are skipped
    that epoch, as torch's DistributedSampler with loaders that drop their
    last short batch (see the module's text).
    """

    def __init__(self, model, data, *, val_data=None, checkpoint_dir=None, address=None, verbose=True, **fields):
        unknown = set(fields) - set(_FIELDS)
        if unknown:
            raise ConfigError(f"unknown TrainJob option(s): {', '.join(sorted(unknown))} "
                              f"(known: {', '.join(sorted(_FIELDS))})")
        for key, value in fields.items():
            kind = _FIELDS[key]
            ok = isinstance(value, kind) or (kind is float and isinstance(value, int) and not isinstance(value, bool))
            if not ok or (kind is int and isinstance(value, bool)):
                raise ConfigError(f"TrainJob option {key}={value!r} must be {_KIND_WORDS.get(kind, kind.__name__)}, "
                                  f"not {type(value).__name__}")
            if kind is float and not math.isfinite(value):  # NaN and inf are no JSON for troupe-train
                raise ConfigError(f"TrainJob option {key}={value!r} must be a finite number")
        self._model = model
        self._data = data
        self._val_data = val_data
        self._fields = fields
        self._checkpoint_dir = checkpoint_dir
        self._address = address
        self._verbose = verbose
        self._work = None
        self._made_checkpoint_dir = False
        self._proc = None
        self._output = []
        self._reader = None
        self._config = {}

    @property
    def metrics_path(self):
        """The JSON-lines metrics file of the running job (None before start())."""
        return os.path.join(self._work.name, "metrics.jsonl") if self._work else None

    def fit(self):
        """Runs the job to its end: a TrainJobResult, or TrainingFailedError /
        ConfigError."""
        self.start()
        return self.wait()

    def start(self):
        """Starts the job and returns at once (fit() = start() + wait())."""
        if self._proc is not None:
            raise RuntimeError("this TrainJob was started already")
        self._work = tempfile.TemporaryDirectory(prefix="troupe-trainjob-")
        work = self._work.name
        config = {k: v for k, v in self._fields.items()}
        config["model"] = _save_model(self._model, work, _data_keys(self._data))
        config["data"] = _save_data(self._data, work, "data")
        if self._val_data is not None:
            config["val_data"] = _save_data(self._val_data, work, "val_data")
        env = dict(os.environ)
        address, embedded = self._cluster_address(env)
        binary = _train_binary()
        # Made once the input, the cluster and the binary are known good
        # (one made before a refusal was left behind). Left for the caller
        # (result.path): the final weights are there.
        self._made_checkpoint_dir = self._checkpoint_dir is None
        if self._made_checkpoint_dir:
            self._checkpoint_dir = tempfile.mkdtemp(prefix="troupe-trainjob-ckpt-")
        try:
            self._launch(binary, work, env, address, embedded, config)
        except BaseException:
            if self._proc is not None:
                # Started, then a Ctrl-C taken as the signal mask came back:
                # the job is ended as wait() ends it, checkpointing the step
                # reached (its folder is the job's now).
                self._start_reader()
                self.stop()
                raise
            # Not started (job.json not written, troupe-train not a program
            # after all, Ctrl-C): the folder made for it goes, as for any
            # refusal, and a second start() does not take it for the user's.
            if self._made_checkpoint_dir:
                shutil.rmtree(self._checkpoint_dir, ignore_errors=True)
                self._checkpoint_dir = None
            raise
        self._start_reader()
        return self

    def _start_reader(self):
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _launch(self, binary, work, env, address, embedded, config):
        """Writes job.json and starts troupe-train on it."""
        config["checkpoint_dir"] = os.path.abspath(self._checkpoint_dir)
        config["metrics"] = self.metrics_path
        if address:
            config["address"] = address
        # What this TrainJob saved is in the driver's temp folder, which
        # other hosts do not see: on a cluster the driver sends it to them
        # (an embedded one's nodes are this host).
        saved = [config["model"], config["data"], config.get("val_data")]
        if address and not embedded and "ship_files" not in config and \
                any(isinstance(p, str) and p.startswith(work) for p in saved):
            config["ship_files"] = True
        with open(os.path.join(work, "job.json"), "w") as f:
            json.dump(config, f)
        self._config = config
        # troupe-train starts with its stop signals blocked (the mask
        # survives exec) and takes them once LibTorch has loaded: a stop()
        # or Ctrl-C in its first half second waits for that, rather than
        # killing it without a word.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK,
                                         {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})
        try:
            self._proc = subprocess.Popen([binary, "--config", os.path.join(work, "job.json")], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _cluster_address(self, env):
        """The cluster's address (None: an embedded one of troupe-train's
        own), and whether it is this process's embedded cluster."""
        if self._address is not None:
            return self._address, False
        import troupe

        if troupe.is_initialized():
            client = troupe._client()
            env["TROUPE_TOKEN"] = client.token
            return client.address, bool(getattr(troupe._state, "embedded", False))
        # troupe-train joins the cluster TROUPE_ADDRESS names (troupe submit
        # and troupe slurm set it), else starts an embedded one.
        address = env.get("TROUPE_ADDRESS") or None
        return address, address is None

    def _pump(self):
        # A `troupe train: ` line and those after it, held back until a
        # progress line ("[name] ...") follows: when they end a failed run
        # they are the reason wait() raises, not to be printed besides.
        held = []

        def show(lines):
            if self._verbose and lines:
                sys.stdout.write("".join(_python_terms(ln, self._work.name, self._config) for ln in lines))
                sys.stdout.flush()

        for line in self._proc.stdout:
            self._output.append(line)
            if line.startswith("troupe train: "):
                show(held)
                held = [line]
            elif held and not line.startswith("["):
                held.append(line)
            else:
                show(held + [line])
                held = []
        if self._proc.wait() == 0:
            show(held)

    def progress(self):
        """The step lines written so far (a running job's history)."""
        return _kept_steps(_read_lines(self.metrics_path)) if self._work else []

    def wait(self, timeout=None):
        """Waits for the job's end: its TrainJobResult, or the error."""
        timeout = _timeouts.seconds(timeout, "TrainJob.wait")
        if self._proc is None:
            raise RuntimeError("start() the TrainJob first")
        try:
            code = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"TrainJob still running after {timeout} s") from None
        except BaseException:
            # Ctrl-C (KeyboardInterrupt) or any other end of the waiting
            # caller ends the job with it, checkpointing the step reached,
            # rather than leaving troupe-train training on unseen.
            self.stop()
            raise
        self._reader.join(timeout=30)
        output = "".join(self._output)
        lines = _read_lines(self.metrics_path)
        self._work.cleanup()
        if code != 0 and self._made_checkpoint_dir:
            # A job refused before its first checkpoint leaves no empty
            # folder of ours behind.
            try:
                os.rmdir(self._checkpoint_dir)
            except OSError:
                pass  # it holds a checkpoint to resume from
        if code != 0:
            message = _python_terms(_reason(output), self._work.name, self._config)
            if code < 0:
                # Killed (the OOM killer, a segfault, stop()'s SIGKILL): its
                # last line of its own is not why it ended ("resuming from"
                # and every progress line after it, or a SIGTERM's promise
                # of a checkpoint it never wrote).
                message = _killed_message(-code, self._checkpoint_dir)
            message = message or f"troupe-train exited with {code}"
            if code == 2:
                raise ConfigError(message)
            raise TrainingFailedError(message, TrainJobResult(lines, None, self._checkpoint_dir, output))
        return TrainJobResult(lines, self._final_checkpoint(output), self._checkpoint_dir, output)

    def _final_checkpoint(self, output):
        marker = "troupe train: final checkpoint "
        for line in output.splitlines():
            if line.startswith(marker):
                return line[len(marker):].split(" (")[0]
        return None

    def stop(self, timeout=30):
        """Stops a running job: SIGTERM to its driver, which checkpoints the
        step reached and exits (wait() then raises TrainingFailedError
        naming the checkpoint; resume=True goes on from it); SIGKILL when
        it has not ended within `timeout` seconds."""
        timeout = _timeouts.seconds(timeout, "TrainJob.stop")
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

