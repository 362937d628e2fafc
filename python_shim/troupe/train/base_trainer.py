"""Ray's ray.train.base_trainer, where Ray Train scripts import
TrainingFailedError from."""

from .trainer import TrainingFailedError

__all__ = ["TrainingFailedError"]
