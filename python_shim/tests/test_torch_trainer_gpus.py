"""TorchTrainer's workers on a node with GPUs see the node's GPUs in
local-rank order, as torchrun's ranks and Ray Train's workers do, so that a
loop written for torchrun (`torch.cuda.set_device(LOCAL_RANK)`,
`DDP(model, device_ids=[local_rank])`) finds its own GPU. Each worker is an
actor that the node agent gives its own GPU alone; a node's second worker
failed with "invalid device ordinal".

The cluster offers 2 GPUs that this machine need not have: the mask is what
is checked (torch without CUDA trains on the CPU, over gloo). The mapping's
edge cases (parts of one GPU, workers of several GPUs) are checked without
a cluster.
"""

import importlib
import os
import sys

import pytest
import torch
from timebox import bounded_fixture

import troupe
from troupe import train
from troupe.train import trainer as trainer_module
from troupe.train import worker as worker_module
from troupe.train.torch import TorchTrainer

bounded = bounded_fixture(240)

importlib.import_module("cloudpickle").register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def gpu_cluster():
    trainer_module.use_runtime("troupe")
    troupe.init(num_cpus=4, num_gpus=2)
    yield
    troupe.shutdown()


def mask_loop():
    ctx = train.get_context()
    mine = {"rank": ctx.get_world_rank(), "local_rank": int(os.environ["LOCAL_RANK"]),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, mine)
    train.report({"ranks": out})


def test_workers_see_their_nodes_gpus_in_local_rank_order(gpu_cluster, tmp_path):
    scaling = train.ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"CPU": 1, "GPU": 1})
    result = TorchTrainer(mask_loop, scaling_config=scaling,
                          run_config=train.RunConfig(name="gpus", storage_path=str(tmp_path))).fit()
    ranks = result.metrics["ranks"]
    assert [r["visible"] for r in ranks] == ["0,1", "0,1"] or [r["visible"] for r in ranks] == ["1,0", "1,0"], ranks
    assert sorted(r["local_rank"] for r in ranks) == [0, 1]


def test_a_worker_finds_its_own_gpu_at_its_local_rank():
    infos = [{"node_id": "a", "gpus": "3"}, {"node_id": "a", "gpus": "1"}, {"node_id": "b", "gpus": "0"}]
    lists = worker_module.node_gpu_lists(infos)
    assert lists == {"a": ["3", "1"], "b": ["0"]}
    assert worker_module.node_visible_gpus(lists["a"], "3") == ("3,1", 0)
    assert worker_module.node_visible_gpus(lists["a"], "1") == ("3,1", 1)
    # Parts of one GPU: both workers use it.
    halves = worker_module.node_gpu_lists([{"node_id": "a", "gpus": "0"}, {"node_id": "a", "gpus": "0"}])
    assert halves == {"a": ["0"]} and worker_module.node_visible_gpus(halves["a"], "0") == ("0", 0)
    # Two GPUs a worker: its device is its first.
    pairs = worker_module.node_gpu_lists([{"node_id": "a", "gpus": "0,1"}, {"node_id": "a", "gpus": "2,3"}])
    assert worker_module.node_visible_gpus(pairs["a"], "2,3") == ("0,1,2,3", 2)
    # A worker that names no GPU leaves its node's workers as they are.
    assert worker_module.node_gpu_lists([{"node_id": "a", "gpus": "0"}, {"node_id": "a", "gpus": ""}]) == {}
    assert worker_module.node_visible_gpus(None, "0") is None
    assert worker_module.node_visible_gpus(["0"], "") is None
