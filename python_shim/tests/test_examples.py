"""One torchrun-style DDP training (examples/torchrun/) run three ways, each
with a worker SIGKILLed mid-run and the run finishing: the unmodified script
under `troupe torchrun`, the same training as a TorchTrainer loop, and on
the C++ TrainJob from Python. Then examples/train_lm, small, with a trainer
SIGKILLed: it heals, its validation loss falls and it writes a sample."""
import os
import subprocess
import sys

import pytest

from conftest import cli

pytest.importorskip("torch")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples", "torchrun")


def run(args, tmp_path, timeout=300):
    env = dict(os.environ, TROUPE_LOG_LEVEL="error")
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    return text


def test_unmodified_script_under_troupe_torchrun(tmp_path):
    text = run([cli(), "torchrun", "--nproc-per-node", "2", "--max-restarts", "2", "--python", sys.executable,
                os.path.join(EXAMPLES, "train_ddp.py"), "--epochs", "3", "--kill-rank", "1", "--kill-step", "12",
                "--checkpoint", str(tmp_path / "ck.pt")], tmp_path)
    assert "resumed from epoch" in text and "restart 1" in text, text[-3000:]
    assert "epoch 2 step" in text


def test_same_training_as_a_torchtrainer_loop(tmp_path):
    text = run([sys.executable, os.path.join(EXAMPLES, "train_torchtrainer.py"), "--epochs", "3", "--kill-rank",
                "1", "--kill-step", "12", "--storage", str(tmp_path / "runs")], tmp_path)
    assert "(restart 1)" in text and "done: {'epoch': 2" in text, text[-3000:]


def test_same_training_on_the_cpp_trainjob(tmp_path):
    text = run([sys.executable, os.path.join(EXAMPLES, "train_trainjob.py"), "--epochs", "3",
                "--kill-after-steps", "20", "--checkpoint-dir", str(tmp_path / "ckpt")], tmp_path)
    if "nothing to kill" in text:
        pytest.fail("the job ended before the kill: " + text[-2000:])
    assert "1 recovery(ies)" in text and "done: 768 steps" in text, text[-3000:]


def test_train_lm_heals_and_its_validation_loss_falls(tmp_path):
    text = run([sys.executable, os.path.join(ROOT, "examples", "train_lm", "train_lm.py"), "--corpus-bytes", "120000",
                "--block-size", "32", "--width", "32", "--layers", "1", "--heads", "2", "--batch-size", "16",
                "--epochs", "2", "--warmup-steps", "10", "--kill-after-steps", "30", "--sample-bytes", "40",
                "--out", str(tmp_path / "lm")], tmp_path)
    if "nothing to kill" in text:
        pytest.fail("the job ended before the kill: " + text[-2000:])
    assert "1 recovery(ies)" in text, text[-3000:]
    assert "epoch 2/2: train loss" in text and "perplexity" in text, text[-3000:]
    assert "sample from the final checkpoint" in text, text[-3000:]


def test_train_lm_bad_input_is_one_line_and_leaves_no_folder(tmp_path):
    # Data too small for one step: refused by the job, said in one line
    # (not a traceback), and the temporary folder the run made is removed.
    env = dict(os.environ, TROUPE_LOG_LEVEL="error", TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_lm", "train_lm.py"),
                          "--corpus-bytes", "20000", "--batch-size", "100000", "--epochs", "1"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("train_lm: ") and "Traceback" not in out.stderr, out.stderr
    assert "batch_size=100000" in out.stderr, out.stderr
    assert not [d for d in os.listdir(tmp_path) if d.startswith("train_lm-")], os.listdir(tmp_path)
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_lm", "train_lm.py"), "--workers", "0"],
                         env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert bad.returncode == 2 and "--workers must be at least 1, got 0" in bad.stderr, bad.stderr
