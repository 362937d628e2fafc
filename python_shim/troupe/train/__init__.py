"""troupe.train: Ray Train's API for PyTorch DDP training on troupe's
actors. A Ray Train script ports by changing `ray.train` to `troupe.train`:

    from troupe.train import ScalingConfig, RunConfig, Checkpoint
    from troupe.train.torch import TorchTrainer, prepare_model

    trainer = TorchTrainer(train_loop, train_loop_config={...},
                           scaling_config=ScalingConfig(num_workers=4),
                           run_config=RunConfig(storage_path="/shared/runs"))
    result = trainer.fit()

Inside the loop: report, get_checkpoint, get_context (session.py); the
model and data: troupe.train.torch (torch.py). How runs, restarts and
checkpoints work: trainer.py and checkpoint.py.
"""

from .checkpoint import Checkpoint
from .config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from .session import TrainContext, get_checkpoint, get_context, get_dataset_shard, report
from .trainer import Result, TorchTrainer, TrainingFailedError
from .job import TrainJob, TrainJobResult

__all__ = [
    "Checkpoint", "CheckpointConfig", "FailureConfig", "RunConfig", "ScalingConfig", "TrainContext",
    "get_checkpoint", "get_context", "get_dataset_shard", "report", "Result", "TorchTrainer", "TrainingFailedError",
    "TrainJob", "TrainJobResult",
]
