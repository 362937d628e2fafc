"""Small TorchScript-able step modules the Python tests train with
troupe.train.TrainJob (forward(batch) returns a dict with "loss")."""
from typing import Dict

import torch


class SumRegression(torch.nn.Module):
    """Learns y = sum(x) from 16 features (batch keys "x" and "y")."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        err = self.net(batch["x"]).squeeze(1) - batch["y"]
        return {"loss": (err * err).mean()}
