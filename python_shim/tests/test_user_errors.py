"""A TrainJob whose own code raises fails at once, naming the user's error.
A step that raises (a TorchScript `raise`) raises on every retry and every
replacement: it used to be taken for a crashed trainer, retried up to
max_failures (forever with -1), and reported as a peer's aborted allreduce
instead of the user's message."""
from typing import Dict

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from troupe.train import TrainJob  # noqa: E402


class CorruptSampleStep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        if bool((batch["value"] > 100.0).any()):
            raise RuntimeError("user step: a corrupt sample (value over 100)")
        err = self.net(batch["features"]).squeeze(1) - batch["value"]
        return {"loss": (err * err).mean()}


def test_a_step_that_raises_fails_the_job_at_once_with_its_message(tmp_path):
    rng = np.random.default_rng(0)
    data = {"features": rng.standard_normal((64, 8)).astype(np.float32),
            "value": rng.standard_normal(64).astype(np.float32)}
    data["value"][13] = 1000.0
    job = TrainJob(CorruptSampleStep(), data, workers=2, epochs=2, batch_size=4, optimizer="sgd", lr=0.01,
                   max_failures=-1, seed=1, verbose=False, checkpoint_dir=str(tmp_path)).start()
    # Bounded by the wait: retried forever (as before), it would time out
    # with another message.
    with pytest.raises(Exception, match="a corrupt sample") as e:
        job.wait(timeout=240)
    assert "failure 2" not in str(e.value), str(e.value)[-2000:]  # not retried


def test_resuming_mid_epoch_in_another_data_order_is_refused(tmp_path):
    # A checkpoint's cursor is a position in its run's data order; resumed
    # with another seed (or other data) it would repeat some samples and
    # skip others, silently.
    from conftest import wait_until
    from test_trainjob import JOB, model, regression
    from troupe.exceptions import ConfigError
    from troupe.train.trainer import TrainingFailedError

    data = regression(1024)
    job_args = dict(JOB, epochs=12, log_every=4)
    job = TrainJob(model(), data, checkpoint_dir=str(tmp_path), **job_args).start()
    wait_until(lambda: len(job.progress()) >= 10, timeout=120, what="ten steps")
    job.stop()
    with pytest.raises(TrainingFailedError) as info:
        job.wait(timeout=60)
    stopped_at = int(str(info.value).split("interrupted at step ")[1].split(",")[0])
    steps_per_epoch = 1024 // 2 // 16
    if stopped_at % steps_per_epoch == 0:
        pytest.skip(f"stopped at an epoch's end (step {stopped_at}): any order may follow")
    with pytest.raises(ConfigError, match="repeat some samples and skip others"):
        TrainJob(model(), data, checkpoint_dir=str(tmp_path), resume=True, **dict(job_args, seed=4)).fit()
    with pytest.raises(ConfigError, match="dataset_size=1024"):
        TrainJob(model(), regression(1100), checkpoint_dir=str(tmp_path), resume=True, **job_args).fit()
    # The same order goes on.
    resumed = TrainJob(model(), data, checkpoint_dir=str(tmp_path), resume=True, **job_args).fit()
    assert resumed.history[0]["step"] == stopped_at + 1
