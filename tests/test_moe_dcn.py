"""Experts across hosts: `[mesh.dcn] expert = k` (mesh_configs/dp2-ep4-dcn.toml) splits the expert axis over hosts,
so the expert kernel's all-to-alls cross them, and a 2-process x 4-device run trains as the 1-process 8-device run
(tests/test_multiprocess.py starts the processes the same way)."""
import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxpar.core.mesh import make_mesh
from jaxpar.core.strategy import AXES, parse_strategy
from jaxpar.models.config import parse_model
from jaxpar.training.data import Synthetic
from jaxpar.training.trainer import TrainConfig, Trainer, train

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

MESH, MODEL = "dp2-ep4-dcn", "moe-tiny:capacity_factor=1.0"
STEPS, BATCH, SEQ = 3, 16, 32
METRICS = ("loss", "moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_load_max", "moe_load_min")


def test_expert_groups_cross_the_hosts():
    """In one process consecutive groups of 4 devices stand in for the 2 hosts (jaxpar/core/mesh.py): every
    expert group has 2 devices on each host, and each host holds both data replicas."""
    mesh = make_mesh(parse_strategy(MESH))
    host = np.vectorize(lambda d: d.id // 4)(mesh.devices)
    groups = np.moveaxis(host, AXES.index("expert"), -1).reshape(-1, 4)          # [data, expert]
    assert (np.sort(groups, axis=1) == [0, 0, 1, 1]).all()
    replicas = np.moveaxis(host, AXES.index("data"), -1).reshape(-1, 2)            # [expert, data]
    assert (replicas == replicas[:, :1]).all()


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 3])
def test_two_processes_match_one_with_experts_across_hosts(zero, tmp_path):
    """2 processes x 4 devices, each expert all-to-all between them: the loss and router metrics of every step
    equal the 1-process run's (rtol 1e-5); zero=3 also shards every weight over the expert group, across the
    hosts too (jaxpar.core.rules.zero3_axes). About a minute each (two processes compile and start)."""
    out = subprocess.run([sys.executable, "-m", "jaxpar.cli.main", "launch", "--processes", "2",
                          "--devices-per-process", "4", "--", "train", "--model", MODEL, "--mesh", MESH,
                          "--steps", str(STEPS), "--batch", str(BATCH), "--seq", str(SEQ), "--no-progress", "--zero", str(zero),
                          "--metrics", str(tmp_path / "m.jsonl")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    trainer = Trainer(parse_model(MODEL), parse_strategy(MESH).with_options(zero=zero),
                      TrainConfig(batch=BATCH, seq=SEQ, steps=STEPS))
    want = []
    train(trainer, Synthetic(trainer.model_cfg.vocab, 0), on_step=lambda _, m: want.append(m))
    assert len(got) == len(want) == STEPS
    for name in METRICS:
        np.testing.assert_allclose([m[name] for m in got], [float(m[name]) for m in want], rtol=1e-5, err_msg=name)
