"""troupe.train.TrainJob: the C++ TrainJob driven from Python. A run's
history, events and checkpoint come back as Python objects; a trainer
SIGKILLed mid-run heals from its live peer and the final weights are
bitwise equal to a failure-free run's; bad input is a ConfigError naming
it."""
import json
import os
import signal
import sys
from typing import Dict, List

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import troupe  # noqa: E402
from troupe.exceptions import ConfigError  # noqa: E402
from troupe.train import TrainJob  # noqa: E402
from troupe.train.trainer import TrainingFailedError  # noqa: E402
from conftest import wait_until  # noqa: E402

TRAINER_CLASS = "troupe::trainer::TrainerActor"


class Step(torch.nn.Module):
    summed_metrics: List[str]

    def __init__(self, loss_key: str = "loss"):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.summed_metrics = ["count"]
        self.loss_key = loss_key

    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        err = self.net(batch["features"]).squeeze(1) - batch["value"]
        out = {"mae": err.abs().mean().detach(), "count": torch.tensor(float(err.shape[0]))}
        out[self.loss_key] = (err * err).mean()
        return out


def regression(n, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(8)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    return {"features": x, "value": (x @ w + 0.1 * rng.standard_normal(n)).astype(np.float32)}


def model():
    torch.manual_seed(0)
    return Step()


class PlainNet(torch.nn.Module):
    """A network, not a step module: forward(x) -> y."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.net(x)


class NeedsPython(torch.nn.Module):
    """A step module TorchScript cannot compile (NumPy in forward)."""

    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {"loss": torch.tensor(np.mean(batch["value"].numpy()))}


JOB = dict(workers=2, epochs=2, batch_size=16, optimizer="adamw", lr=0.01, seed=3, verbose=False)


def test_fit_returns_history_events_and_a_loadable_checkpoint(tmp_path):
    # keep_checkpoints and replacement_timeout: job-file keys that TrainJob
    # refused as unknown before.
    result = TrainJob(model(), regression(512), val_data=regression(128, 1), checkpoint_dir=str(tmp_path),
                      checkpoint_every=10, keep_checkpoints=2, replacement_timeout=5.0, **JOB).fit()
    steps = [h["step"] for h in result.history]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] == 2 * 512 // 32
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    assert all(h["world_size"] == 2 and "mae" in h for h in result.history)
    assert [e["epoch"] for e in result.epochs] == [0, 1] and "mae" in result.metrics["val_metrics"]
    assert {e["event"] for e in result.events} >= {"placed", "finished"} and result.recoveries == 0
    # checkpoint_every=10 of 16 steps an epoch: inside the epochs and at their ends.
    assert [e["step"] for e in result.events if e["event"] == "checkpoint"] == [10, 16, 20, 30, 32]
    assert "train_accuracy" not in result.metrics and "val_loss" in result.metrics  # a regression: no accuracy
    weights = result.state_dict()
    assert set(weights) == {name for name, _ in Step().named_parameters()}
    assert os.path.dirname(result.checkpoint).startswith(str(tmp_path))
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == ["step-00000030", "step-00000032"]


class Classifier(torch.nn.Module):
    """A network, forward(x) -> logits, as `troupe train` takes one."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.net(x)


def test_a_network_over_input_and_target_trains_as_troupe_train_trains_it(tmp_path):
    # As `troupe train --model net.pt` does (the `classification` step):
    # TrainJob refused it as no step module.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 8)).astype(np.float32)
    data = {"input": x, "target": (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0).astype(np.int64)}
    torch.manual_seed(0)
    np.savez(tmp_path / "cls.npz", **data)
    for given in (data, str(tmp_path / "cls.npz")):
        result = TrainJob(Classifier(), given, checkpoint_dir=str(tmp_path / f"ckpt-{type(given).__name__}"),
                          **JOB).fit()
        assert "accuracy" in result.history[-1], result.history[-1]
        assert result.history[-1]["loss"] < result.history[0]["loss"]
        assert set(result.state_dict()) == {"net.weight", "net.bias"}


def test_accumulation_trains_as_one_batch_of_that_many(tmp_path):
    # Two micro-batches of 8 per worker and one optimizer step: the same
    # samples, the same mean loss and so (to rounding) the same weights as
    # one batch of 16. Without accumulation reaching the trainers, the job
    # would take twice the steps of 8 and end elsewhere.
    job = dict(workers=2, epochs=2, optimizer="sgd", momentum=0.0, lr=0.05, seed=3, verbose=False)
    data = regression(128)
    accumulated = TrainJob(model(), data, batch_size=8, accumulation=2, checkpoint_dir=str(tmp_path / "a"),
                           **job).fit()
    whole = TrainJob(model(), data, batch_size=16, checkpoint_dir=str(tmp_path / "b"), **job).fit()
    assert [h["step"] for h in accumulated.history] == list(range(1, 9))  # 128 / 2 workers / 16, 2 epochs
    assert [h["samples"] for h in accumulated.history] == [32] * 8
    a, b = accumulated.state_dict(), whole.state_dict()
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a), "accumulated weights differ"
    with pytest.raises(ConfigError, match="accumulation must be between 1 and 1048576, got 0"):
        TrainJob(model(), data, batch_size=8, accumulation=0, checkpoint_dir=str(tmp_path / "c"), **job).fit()


def test_a_job_refused_before_it_starts_leaves_no_checkpoint_folder(tmp_path, monkeypatch):
    """Without troupe-train, fit() is a ConfigError naming it, and the
    temporary checkpoint folder TrainJob makes when given none is not left
    behind (one was, for every refused fit())."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TROUPE_TRAIN", str(tmp_path / "no-such-binary"))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with pytest.raises(ConfigError, match="no-such-binary is not an executable file"):
        TrainJob(model(), regression(64), workers=1, epochs=1, verbose=False).fit()
    assert not list(scratch.glob("troupe-trainjob-ckpt-*"))
    # Executable but not a program: the launch itself fails (ENOEXEC).
    garbage = tmp_path / "not-a-program"
    garbage.write_bytes(b"\x00\x01\x02 not an executable format")
    garbage.chmod(0o755)
    monkeypatch.setenv("TROUPE_TRAIN", str(garbage))
    with pytest.raises(OSError):
        TrainJob(model(), regression(64), workers=1, epochs=1, verbose=False).fit()
    assert not list(scratch.glob("troupe-trainjob-ckpt-*"))


def trainer_pids():
    status = json.loads(troupe._client().status_json())
    return [a["pid"] for a in status["actors"] if a["class"] == TRAINER_CLASS and a["state"] == "ALIVE"]


def test_killed_trainer_heals_to_the_same_weights(tmp_path):
    data = regression(1024)
    # Long enough (384 steps) that the kill, sent once ten steps are done,
    # always lands mid-run: 64 steps could all be done before it arrived.
    long_job = dict(JOB, epochs=12)
    clean = TrainJob(model(), data, checkpoint_dir=str(tmp_path / "clean"), max_failures=1, **long_job).fit()

    troupe.init(num_cpus=4)
    try:
        job = TrainJob(model(), data, checkpoint_dir=str(tmp_path / "healed"), max_failures=1, **long_job).start()
        wait_until(lambda: len(job.progress()) >= 10 and len(trainer_pids()) == 2, timeout=120,
                   what="ten steps with two trainers")
        os.kill(trainer_pids()[1], signal.SIGKILL)
        healed = job.wait(timeout=300)
    finally:
        troupe.shutdown()

    assert healed.recoveries == 1, healed.events
    assert "healed" in {e["event"] for e in healed.events}, healed.events
    assert healed.history[-1]["step"] == clean.history[-1]["step"]
    # Heal loses no step: every step number ran once.
    steps = [h["step"] for h in healed.history]
    assert len(steps) == len(set(steps))
    a, b = clean.state_dict(), healed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), "healed weights differ from the failure-free run's"


def test_stop_checkpoints_and_resume_ends_with_the_same_weights(tmp_path):
    # stop() (SIGTERM to the driver, as a batch system's time limit sends)
    # ends the job at its next round of steps with a checkpoint there;
    # resume=True goes on from that step and ends with the weights of a run
    # never stopped.
    data = regression(1024)
    long_job = dict(JOB, epochs=12, log_every=4)
    clean = TrainJob(model(), data, checkpoint_dir=str(tmp_path / "clean"), **long_job).fit()
    job = TrainJob(model(), data, checkpoint_dir=str(tmp_path / "cut"), **long_job).start()
    wait_until(lambda: len(job.progress()) >= 10, timeout=120, what="ten steps")
    job.stop()
    with pytest.raises(TrainingFailedError, match=r"interrupted at step \d+, checkpoint .*resume=True") as info:
        job.wait(timeout=60)
    stopped_at = int(str(info.value).split("interrupted at step ")[1].split(",")[0])
    assert 10 <= stopped_at < clean.history[-1]["step"]
    resumed = TrainJob(model(), data, checkpoint_dir=str(tmp_path / "cut"), resume=True, **long_job).fit()
    assert resumed.history[0]["step"] == stopped_at + 1
    assert resumed.history[-1]["step"] == clean.history[-1]["step"]
    a, b = clean.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the run never stopped"


def test_a_job_killed_by_a_signal_says_so_not_its_last_line(tmp_path):
    # Killed (the OOM killer, a segfault, stop()'s SIGKILL), its error was
    # its last line of its own ("resuming from ...") and every progress line
    # after it, with nothing of the kill.
    data = regression(1024)
    long_job = dict(JOB, epochs=50, log_every=1, checkpoint_every=4)
    first = TrainJob(model(), data, checkpoint_dir=str(tmp_path / "ckpt"), **dict(JOB, epochs=1)).fit()
    assert first.checkpoint
    job = TrainJob(model(), data, checkpoint_dir=str(tmp_path / "ckpt"), resume=True, **long_job).start()
    wait_until(lambda: len(job.progress()) >= 3, timeout=120, what="three steps")
    os.kill(job._proc.pid, signal.SIGKILL)
    with pytest.raises(TrainingFailedError) as info:
        job.wait(timeout=60)
    message = str(info.value)
    assert message.startswith("troupe-train was killed by SIGKILL; its newest checkpoint is "), message
    assert "resuming from" not in message and "step" not in message.split("checkpoint is ")[0], message


def test_a_stop_right_after_start_is_an_interrupt_that_leaves_nothing(tmp_path):
    # stop() at once: troupe-train takes the SIGTERM once it can (it used to
    # die of it before, "exited with -15"), and the checkpoint folder it
    # made is gone again, with the folders it made to hold it.
    job = TrainJob(model(), regression(256), checkpoint_dir=str(tmp_path / "runs" / "a" / "ckpt"), **JOB).start()
    job.stop(timeout=120)
    # Taken while troupe-train checks its files, or at the first wait.
    taken = r"interrupted (before the job started|while waiting for [^,]+, at step 0, epoch 1 of 2)"
    with pytest.raises(TrainingFailedError, match=taken + r" \(no checkpoint written\)"):
        job.wait(timeout=60)
    assert not (tmp_path / "runs").exists(), list(tmp_path.rglob("*"))


def test_max_steps_stops_mid_epoch_with_a_checkpoint_and_a_resume_goes_on(tmp_path):
    # max_steps reached mid-epoch: a checkpoint of that step, from which a
    # resume with a higher max_steps goes on.
    data = regression(512)
    short = TrainJob(model(), data, checkpoint_dir=str(tmp_path), max_steps=5, **JOB).fit()
    assert short.history[-1]["step"] == 5
    assert os.path.basename(short.checkpoint) == "step-00000005"
    more = TrainJob(model(), data, checkpoint_dir=str(tmp_path), resume=True, max_steps=9, **JOB).fit()
    assert [h["step"] for h in more.history] == [6, 7, 8, 9]
    with pytest.raises(ConfigError, match="max_steps must be 0"):
        TrainJob(model(), data, checkpoint_dir=str(tmp_path / "bad"), max_steps=-2, **JOB).fit()


def test_an_interrupted_wait_stops_the_job(tmp_path):
    # Ctrl-C while fit() or wait() blocks raises KeyboardInterrupt there;
    # the job ends with it (SIGTERM: it checkpoints and exits) instead of
    # training on unseen after the caller has gone.
    job = TrainJob(model(), regression(1024), checkpoint_dir=str(tmp_path), **dict(JOB, epochs=50, log_every=4))
    job.start()
    wait_until(lambda: len(job.progress()) >= 2, timeout=120, what="two steps")
    real_wait = job._proc.wait

    def interrupted(timeout=None):
        job._proc.wait = real_wait
        # A terminal's Ctrl-C reaches the driver too (one process group):
        # its SIGINT and wait()'s SIGTERM are one request, not "stop now"
        # (which ended it without a checkpoint: probe 28b).
        os.kill(job._proc.pid, signal.SIGINT)
        raise KeyboardInterrupt

    job._proc.wait = interrupted
    with pytest.raises(KeyboardInterrupt):
        job.wait()
    code = job._proc.poll()
    assert code is not None, "troupe-train still running after the interrupted wait()"
    assert code == 128 + signal.SIGINT, f"troupe-train did not stop in order on the Ctrl-C: exit {code}"
    assert any(p.name.startswith("step-") for p in tmp_path.iterdir()), list(tmp_path.iterdir())


def test_a_checkpoint_dir_that_holds_a_run_needs_resume(tmp_path):
    # A second job writing into a directory that holds the first one's
    # checkpoints would mix their steps; it is refused unless it resumes,
    # and resuming a finished run has nothing left to train.
    first = TrainJob(model(), regression(256), checkpoint_dir=str(tmp_path), **JOB).fit()
    with pytest.raises(ConfigError, match="already holds a checkpoint.*resume"):
        TrainJob(model(), regression(256), checkpoint_dir=str(tmp_path), **JOB).fit()
    again = TrainJob(model(), regression(256), checkpoint_dir=str(tmp_path), resume=True, **JOB).fit()
    assert again.history == []
    assert any(e["event"] == "resume_from" for e in again.events)
    assert again.checkpoint is None or os.path.basename(again.checkpoint) == os.path.basename(first.checkpoint)
    with pytest.raises(ConfigError, match="resume=1 must be True or False, not int"):
        TrainJob(model(), regression(256), resume=1)
    with pytest.raises(ConfigError, match="epochs=2.5 must be an integer, not float"):
        TrainJob(model(), regression(256), epochs=2.5)


def test_bad_input_is_a_config_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="loss"):
        TrainJob(Step(loss_key="err2"), regression(64), checkpoint_dir=str(tmp_path), **JOB).fit()
    with pytest.raises(ConfigError, match="learning_rate"):
        TrainJob(model(), regression(64), learning_rate=0.1)
    with pytest.raises(ConfigError, match="workers=2.5"):
        TrainJob(model(), regression(64), workers=2.5)
    # Not "job file ... is not JSON: parse error ... invalid literal" from
    # troupe-train, after the job was written and started.
    for key, value in (("lr", float("nan")), ("grad_clip", float("inf")), ("weight_decay", float("-inf"))):
        with pytest.raises(ConfigError, match=f"TrainJob option {key}={value!r} must be a finite number"):
            TrainJob(model(), regression(64), **{key: value})
    bad = regression(64)
    bad["value"] = bad["value"][:10]
    with pytest.raises(ConfigError, match="first"):
        TrainJob(model(), bad, checkpoint_dir=str(tmp_path), **JOB).fit()
    with pytest.raises(ConfigError, match="nothing.npz"):
        TrainJob(model(), "/nonexistent/nothing.npz", **JOB).fit()
    # Refused by troupe-train (batch larger than the data): the checkpoint
    # folder the job made for itself goes with the refusal.
    job = TrainJob(model(), regression(8), **dict(JOB, batch_size=64))
    with pytest.raises(ConfigError, match="data has 8 samples"):
        job.fit()
    assert job._checkpoint_dir and not os.path.exists(job._checkpoint_dir), job._checkpoint_dir
    with pytest.raises(ConfigError, match="amp='fp16'.*gpus_per_worker"):  # fp16 autocast is for GPUs
        TrainJob(model(), regression(64), amp="fp16", checkpoint_dir=str(tmp_path), **JOB).fit()
    with pytest.raises(ConfigError, match="TrainJob.wait: timeout=-1.0"):  # checked before "start() first"
        TrainJob(model(), regression(64), checkpoint_dir=str(tmp_path), **JOB).wait(timeout=-1)
    # Named before troupe-train starts: not "no tensor 'input' in the batch",
    # nor pages of TorchScript's compiler output.
    with pytest.raises(ConfigError, match=r"PlainNet has forward\(x: Tensor\) -> Tensor; TrainJob needs a step "
                                          r"module.*the data's keys: features, value"):
        TrainJob(PlainNet(), regression(64), checkpoint_dir=str(tmp_path), **JOB).fit()
    with pytest.raises(ConfigError, match=r"NeedsPython cannot be compiled with torch.jit.script: .*TorchTrainer"):
        TrainJob(NeedsPython(), regression(64), checkpoint_dir=str(tmp_path), **JOB).fit()


def test_data_errors_name_the_python_arguments(tmp_path):
    # Once numpy's own ValueError ("setting an array element with a
    # sequence"), or troupe-train's lines about "--data /tmp/troupe-trainjob-
    # .../data.npz" (a file deleted by then) and flags never given.
    ragged = dict(regression(16), features=[[0.1] * 8, [0.2] * 7] * 8)
    with pytest.raises(ConfigError, match=r"data\['features'\] is ragged: .*sample 0 has shape \(8,\), "
                                          r"sample 1 has shape \(7,\)"):
        TrainJob(model(), ragged, checkpoint_dir=str(tmp_path), **JOB).fit()
    objects = dict(regression(16), value=np.array([None] * 16))
    with pytest.raises(ConfigError, match=r"data\['value'\] has dtype object .*float32"):
        TrainJob(model(), objects, checkpoint_dir=str(tmp_path), **JOB).fit()
    strings = dict(regression(16), value=np.array(["1.5"] * 16))
    with pytest.raises(ConfigError, match=r"val_data\['value'\] has dtype <U3 \(strings\)"):
        TrainJob(model(), regression(64), val_data=strings, checkpoint_dir=str(tmp_path), **JOB).fit()
    with pytest.raises(ConfigError, match=r"data\['value'\] has dtype uint16 .*signed"):
        TrainJob(model(), dict(regression(16), value=np.zeros(16, np.uint16)), checkpoint_dir=str(tmp_path),
                 **JOB).fit()
    with pytest.raises(ConfigError, match=r"data\['value'\] is a single value"):
        TrainJob(model(), dict(regression(16), value=np.float32(1)), checkpoint_dir=str(tmp_path), **JOB).fit()
    # Big-endian arrays are the user's machine's business, not an error.
    swapped = {k: v.astype(v.dtype.newbyteorder(">")) for k, v in regression(64).items()}
    assert TrainJob(model(), swapped, checkpoint_dir=str(tmp_path / "be"), **dict(JOB, epochs=1)).fit().history
    # troupe-train's refusal, in TrainJob's terms.
    with pytest.raises(ConfigError) as info:
        TrainJob(model(), regression(16), checkpoint_dir=str(tmp_path / "small"), **dict(JOB, batch_size=64)).fit()
    message = str(info.value)
    assert message == "data has 16 samples, fewer than one step of workers=2 × batch_size=64 = 128", message
    path = str(tmp_path / "small.npz")
    np.savez(path, **regression(16))
    with pytest.raises(ConfigError) as info:
        TrainJob(model(), path, checkpoint_dir=str(tmp_path / "small"), **dict(JOB, batch_size=64)).fit()
    assert str(info.value).startswith(f"data={path!r} has 16 samples, fewer than one step of workers=2 × "), info.value


def test_model_options_errors_are_told_once_in_trainjobs_terms(tmp_path, capsys):
    # Once "job file /tmp/troupe-trainjob-.../job.json: key 'model_options.hidden'
    # ...", printed by the driver's echoed output and again in the ConfigError.
    with pytest.raises(ConfigError) as info:
        TrainJob(model(), regression(64), checkpoint_dir=str(tmp_path / "a"), model_options={"hidden": "big"},
                 **dict(JOB, verbose=True)).fit()
    assert str(info.value) == "model_options['hidden'] must be an integer, got \"big\"", info.value
    out, err = capsys.readouterr()
    assert "must be an integer" not in out + err, out + err
    # A TorchScript module has its own sizes: model_options is refused, not ignored.
    with pytest.raises(ConfigError) as info:
        TrainJob(model(), regression(64), checkpoint_dir=str(tmp_path / "b"), model_options={"hidden": 8},
                 **dict(JOB, verbose=True)).fit()
    message = str(info.value)
    assert message.startswith("model_options (hidden=8) sizes a built-in model (mlp, cnn); model is a TorchScript "
                              "module"), message
    assert "job.json" not in message and "troupe-trainjob" not in message, message
    out, err = capsys.readouterr()
    assert "sizes a built-in model" not in out + err, out + err


def test_relative_paths_are_the_working_directorys(tmp_path, monkeypatch):
    # troupe-train reads a job file's relative paths from the job file's
    # folder (this TrainJob's temporary one): TrainJob gives it absolute ones.
    monkeypatch.chdir(tmp_path)
    np.savez("train.npz", **regression(64))
    torch.jit.save(torch.jit.script(model()), "step.pt")
    result = TrainJob("step.pt", "train.npz", checkpoint_dir="ckpt", **dict(JOB, epochs=1)).fit()
    assert result.history and result.checkpoint.startswith(str(tmp_path / "ckpt")), result.checkpoint


class Count(torch.nn.Module):
    """Counts, per sample index, how often a step trained it (summed over
    the workers)."""
    summed_metrics: List[str]

    def __init__(self, n: int):
        super().__init__()
        self.w = torch.nn.Linear(1, 1)
        self.n = n
        self.summed_metrics = ["c" + str(i) for i in range(n)]

    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        out: Dict[str, torch.Tensor] = {"loss": self.w(batch["x"]).pow(2).mean()}
        for i in range(self.n):
            out["c" + str(i)] = (batch["idx"] == i).sum().to(torch.float32)
        return out


def test_an_epoch_skips_the_samples_that_do_not_fill_a_last_step(tmp_path):
    # What the docstring (once "exactly-once data", read as "every sample
    # each epoch") now says: 21 samples, 2 workers × batch 4 = 8 a step,
    # ceil(21 / 2) // 4 = 2 steps an epoch; the last 5 of the epoch's
    # order, torch.randperm seeded with seed + epoch, are skipped.
    n, seed = 21, 3
    data = {"x": np.arange(n, dtype=np.float32).reshape(n, 1) / n, "idx": np.arange(n, dtype=np.int64)}
    result = TrainJob(Count(n), data, workers=2, epochs=2, batch_size=4, optimizer="sgd", lr=0.01, seed=seed,
                      log_every=1, checkpoint_dir=str(tmp_path), verbose=False).fit()
    for epoch in range(2):
        steps = [h for h in result.history if h["epoch"] == epoch]
        assert len(steps) == 2, result.history
        counts = [sum(round(h[f"c{i}"]) for h in steps) for i in range(n)]
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        assert counts == [0 if i in order[16:] else 1 for i in range(n)], (epoch, counts, order)
    for doc in (TrainJob.__doc__, sys.modules[TrainJob.__module__].__doc__):
        assert "skipped" in doc and "N - steps * workers * batch_size" in doc


class TinyLm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(256, 16)
        self.out = torch.nn.Linear(16, 256)

    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        logits = self.out(self.embed(batch["input"]))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), batch["target"].reshape(-1))
        return {"loss": loss}


def test_token_stream_with_cosine_schedule_and_bf16_gradients(tmp_path):
    # A language model's data: a .bin of uint16 token ids cut into windows.
    text = (b"the quick brown fox jumps over the lazy dog. " * 400)[:16385]
    np.frombuffer(text, dtype=np.uint8).astype(np.uint16).tofile(tmp_path / "train.bin")
    torch.manual_seed(0)
    result = TrainJob(TinyLm(), str(tmp_path / "train.bin"), block_size=32, workers=2, epochs=2, batch_size=8,
                      optimizer="adamw", lr=0.02, warmup_steps=4, schedule="cosine", min_lr_factor=0.1,
                      compression="bf16", grad_clip=1.0, checkpoint_dir=str(tmp_path / "ck"), verbose=False).fit()
    # 16,385 tokens: 512 windows of 32 (each with its next-token target);
    # 512 / (2 workers × 8) = 32 steps an epoch.
    assert result.history[-1]["step"] == 64
    assert result.history[-1]["loss"] < 0.5 * result.history[0]["loss"]
    # The same under bf16 autocast on the CPU: it learns as well, on other
    # floats.
    torch.manual_seed(0)
    bf16 = TrainJob(TinyLm(), str(tmp_path / "train.bin"), block_size=32, workers=2, epochs=2, batch_size=8,
                    optimizer="adamw", lr=0.02, warmup_steps=4, schedule="cosine", min_lr_factor=0.1,
                    compression="bf16", grad_clip=1.0, amp="bf16", checkpoint_dir=str(tmp_path / "ck-bf16"),
                    verbose=False).fit()
    assert bf16.history[-1]["step"] == 64
    assert bf16.history[-1]["loss"] < 0.5 * bf16.history[0]["loss"]
    assert bf16.history[-1]["loss"] != result.history[-1]["loss"]
    with pytest.raises(ConfigError, match="block_size"):
        TrainJob(TinyLm(), str(tmp_path / "train.bin"), checkpoint_dir=str(tmp_path / "ck2"), verbose=False).fit()
    with pytest.raises(ConfigError, match="schedule"):
        TrainJob(TinyLm(), str(tmp_path / "train.bin"), block_size=32, schedule="linear",
                 checkpoint_dir=str(tmp_path / "ck3"), verbose=False).fit()


def test_history_holds_each_step_once_after_a_restore():
    # A job restored from the checkpoint of step 2 after reaching step 4
    # logs steps 3 and 4 again; the weights hold only their second run.
    from troupe.train.job import TrainJobResult

    def step(n, loss):
        return {"kind": "step", "step": n, "loss": loss}

    lines = [step(1, 9.0), step(2, 8.0), step(3, 7.0), step(4, 6.0),
             {"kind": "event", "event": "failure", "step": 4},
             {"kind": "event", "event": "restored", "step": 2},
             step(3, 7.5), step(4, 6.5), step(5, 5.0)]
    result = TrainJobResult(lines, None, None, "")
    assert [(h["step"], h["loss"]) for h in result.history] == [(1, 9.0), (2, 8.0), (3, 7.5), (4, 6.5), (5, 5.0)]
    assert result.recoveries == 1
    # A job that failed again before it ran the rolled-back steps keeps
    # none of them; an epoch that a restart from the initial weights ran
    # again is there once.
    ended = TrainJobResult(lines[:6] + [{"kind": "event", "event": "failed", "step": 2}], None, None, "")
    assert [h["step"] for h in ended.history] == [1, 2]
    epoch = {"kind": "epoch", "epoch": 0, "step": 2}
    restarted = TrainJobResult([step(1, 9.0), step(2, 8.0), dict(epoch, train_loss=8.5),
                                {"kind": "event", "event": "restored", "step": 0},
                                step(1, 9.1), step(2, 8.1), dict(epoch, train_loss=8.6)], None, None, "")
    assert [(h["step"], h["loss"]) for h in restarted.history] == [(1, 9.1), (2, 8.1)]
    assert [e["train_loss"] for e in restarted.epochs] == [8.6]


def test_a_job_run_under_troupe_submit_counts_as_on_a_cluster():
    # troupe submit and troupe slurm name the cluster in TROUPE_ADDRESS:
    # troupe-train joins it, so a TrainJob given objects ships them (it
    # took the job for an embedded one and shipped nothing).
    assert not troupe.is_initialized()
    job = TrainJob(model(), regression(64))
    assert job._cluster_address({"TROUPE_ADDRESS": "10.0.0.7:6380"}) == ("10.0.0.7:6380", False)
    assert job._cluster_address({}) == (None, True)


def test_a_trainer_that_cannot_see_the_saved_model_is_told_in_trainjobs_terms():
    # A trainer on another host cannot read what TrainJob saved in the
    # driver's temp folder: said so, and what to do (it read "TorchScript
    # model file 'model' does not exist").
    from troupe.train.job import _python_terms

    work = "/tmp/troupe-trainjob-abc"
    message = (f"the model {work}/step.pt is not on node-b, where a trainer runs: trainers read it at that path on "
               "every node, so put it on storage every node shares")
    said = _python_terms(message, work, {})
    assert said.startswith("the model, which TrainJob saved in the driver's temp folder, is not on node-b"), said
    assert "set TMPDIR to a folder every node shares, or give model as a file every node shares" in said, said
