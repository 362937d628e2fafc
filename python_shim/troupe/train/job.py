"""troupe.train.TrainJob: the C++ TrainJob from Python.

The C++ TrainJob (heal from a live peer, bitwise-equal recovery,
exactly-once data) runs the training; this class only hands it a job: the
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
TrainingFailedError with the C++ driver's reason.
"""
import json
import math
import os
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
    "workers": int, "min_workers": int, "max_workers": int, "epochs": int, "batch_size": int, "optimizer": str, "lr": float, "weight_decay": float, "momentum": float,
    "warmup_steps": int, "grad_clip": float, "max_failures": int, "seed": int, "sync_batchnorm": bool,
    "cpus_per_worker": float, "log_every": int, "name": str, "model_options": dict,
    "block_size": int, "token_dtype": str, "schedule": str, "min_lr_factor": float, "compression": str,
    "gpus_per_worker": float, "amp": str, "loader_threads": int, "step_timeout": float, "resume": bool,
    "cpu_gemm": str,
}


def _train_binary():
    from troupe._cli import find_binary

    try:
        return find_binary("troupe-train", "TROUPE_TRAIN")
    except FileNotFoundError as e:
        raise ConfigError(f"TrainJob needs troupe-train, the LibTorch driver of `troupe train` (built with "
                          f"TROUPE_WITH_TORCH=ON): {e}") from None


def _save_model(model, work):
    if isinstance(model, str):
        if os.path.exists(model) or model in ("mlp", "cnn"):
            return model
        raise ConfigError(f"model file {model} does not exist")
    import torch

    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, a TorchScript file or a built-in name, "
                          f"got a {type(model).__name__}")
    scripted = model if isinstance(model, torch.jit.ScriptModule) else torch.jit.script(model)
    path = os.path.join(work, "step.pt")
    torch.jit.save(scripted, path)
    return path


def _save_data(data, work, stem):
    if isinstance(data, str):
        if not os.path.exists(data):
            raise ConfigError(f"{stem} file {data} does not exist")
        return data
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{stem} must be a dict of arrays (batch key -> array) or an .npz path, got {data!r:.80}")
    import numpy as np

    arrays = {}
    for key, value in data.items():
        if hasattr(value, "detach"):  # a torch tensor
            value = value.detach().cpu().numpy()
        arrays[str(key)] = np.ascontiguousarray(value)
    sizes = {k: a.shape[0] if a.ndim else None for k, a in arrays.items()}
    if len(set(sizes.values())) != 1 or None in sizes.values():
        raise ConfigError(f"{stem}: every array needs the same first (sample) dimension, got {sizes}")
    path = os.path.join(work, f"{stem}.npz")
    np.savez(path, **arrays)
    return path


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


class TrainJobResult:
    """What a TrainJob run left: `history` (one dict per optimizer step:
    step, epoch, loss, the step's metrics, samples_per_s, world_size, time),
    `epochs` (one dict per epoch), `events` (placed, failure, healed, ...,
    each with time, step, workers, detail), `recoveries` (failures the job
    survived), `checkpoint` (the final checkpoint's directory: model.pt is a
    {name: tensor} dict for torch.load), `path` (the checkpoint root),
    `metrics` (the last epoch's), `output` (what the driver printed)."""

    def __init__(self, lines, checkpoint, path, output):
        self.history = [j for j in lines if j.get("kind") == "step"]
        self.epochs = [j for j in lines if j.get("kind") == "epoch"]
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
    epochs, batch_size, optimizer, lr, weight_decay, warmup_steps, grad_clip,
    max_failures, seed, sync_batchnorm, cpus_per_worker, log_every, name,
    model_options, block_size, token_dtype, schedule ("constant"/"cosine"),
    min_lr_factor, compression ("none"/"bf16"/"fp16"), gpus_per_worker, amp
    ("none"/"bf16"/"fp16": autocast; bf16 on the CPU too, fp16 on GPUs
    only), loader_threads (pipeline threads of each trainer's data
    loader), step_timeout (seconds a trainer may take to answer before it
    counts as hung and is healed), cpu_gemm ("auto"/"onednn"/"aten": who
    computes the fp32 linear layers of a CPU trainer)). verbose: print the driver's progress lines.
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
                raise ConfigError(f"TrainJob option {key}={value!r} must be a {kind.__name__}")
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
        config["model"] = _save_model(self._model, work)
        config["data"] = _save_data(self._data, work, "data")
        if self._val_data is not None:
            config["val_data"] = _save_data(self._val_data, work, "val_data")
        # Made once the input is known good. Left for the caller
        # (result.path): the final weights are there.
        self._made_checkpoint_dir = self._checkpoint_dir is None
        if self._made_checkpoint_dir:
            self._checkpoint_dir = tempfile.mkdtemp(prefix="troupe-trainjob-ckpt-")
        config["checkpoint_dir"] = os.path.abspath(self._checkpoint_dir)
        config["metrics"] = self.metrics_path
        env = dict(os.environ)
        address = self._cluster_address(env)
        if address:
            config["address"] = address
        with open(os.path.join(work, "job.json"), "w") as f:
            json.dump(config, f)
        self._proc = subprocess.Popen([_train_binary(), "--config", os.path.join(work, "job.json")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()
        return self

    def _cluster_address(self, env):
        if self._address is not None:
            return self._address
        import troupe

        if troupe.is_initialized():
            client = troupe._client()
            env["TROUPE_TOKEN"] = client.token
            return client.address
        return None

    def _pump(self):
        for line in self._proc.stdout:
            self._output.append(line)
            if self._verbose:
                sys.stdout.write(line)
                sys.stdout.flush()

    def progress(self):
        """The step lines written so far (a running job's history)."""
        return [j for j in _read_lines(self.metrics_path) if j.get("kind") == "step"] if self._work else []

    def wait(self, timeout=None):
        """Waits for the job's end: its TrainJobResult, or the error."""
        timeout = _timeouts.seconds(timeout, "TrainJob.wait")
        if self._proc is None:
            raise RuntimeError("start() the TrainJob first")
        try:
            code = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"TrainJob still running after {timeout} s") from None
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
            message = _reason(output) or f"troupe-train exited with {code}"
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

