"""Bad input gives a ConfigError naming the constraint and the values, before anything compiles."""

import jax
import pytest

from jaxpar.cli import main as cli
from jaxpar.devices import simulate_cpu_devices, with_device_count
from jaxpar.errors import ConfigError
from jaxpar.core.strategy import parse_strategy
from jaxpar.training.trainer import TrainConfig, Trainer
from jaxpar.models.config import parse_model


def raises_naming(message, fn, *args):
    """fn(*args) raises ConfigError whose text contains `message`."""
    with pytest.raises(ConfigError) as e:
        fn(*args)
    assert message in str(e.value)


def build(model="llama-tiny", mesh="data=8", batch=16, seq=32, devices=8):
    return Trainer(parse_model(model), parse_strategy(mesh), TrainConfig(batch=batch, seq=seq),
                   devices=jax.devices()[:devices])


@pytest.mark.parametrize("model, mesh, batch, seq, message", [
    ("llama-tiny", "data=2,tensor=2", 16, 32, "axis product 4 (data=2 x tensor=2) != device count 8"),
    ("llama-tiny:kv_heads=3,heads=12", "data=2,tensor=4", 16, 32,
     "tensor=4 > kv_heads=3 replicates K/V heads across tensor ranks, which needs tensor to be a multiple of kv_heads"),
    ("llama-tiny:kv_heads=6,heads=12", "data=2,tensor=4", 16, 32, "tensor=4 does not divide kv_heads=6"),
    ("llama-tiny:heads=4,kv_heads=4", "data=2,tensor=8", 16, 32, "axis product 16"),  # product error first
    ("llama-tiny:heads=6,kv_heads=2", "data=2,tensor=4", 16, 32, "tensor=4 does not divide heads=6"),
    ("llama-tiny:mlp_dim=102", "data=2,tensor=4", 16, 32, "tensor=4 does not divide mlp_dim=102"),
    ("llama-tiny:vocab=254", "data=2,tensor=4", 16, 32, "tensor=4 does not divide vocab=254"),
    ("llama-tiny", "data=8", 12, 32, "batch=12 is not divisible by the data-parallel size data=8 (8)"),
    ("llama-tiny", "data=2,fsdp=4", 4, 32, "batch=4 is not divisible by the data-parallel size data=2xfsdp=4 (8)"),
    ("llama-tiny", "data=8", 16, 512, "seq=512 must be between 1 and the model's max_seq=256"),
    ("llama-tiny:d_model=60", "fsdp=8", 16, 32, "fsdp=8 does not divide d_model=60"),
    ("moe-tiny:experts=6", "data=2,expert=4", 16, 32, "expert=4 does not divide experts=6"),
    ("moe-tiny:expert_mlp_dim=30", "expert=2,tensor=4", 16, 32, "tensor=4 does not divide expert_mlp_dim=30"),
    ("moe-tiny:expert_mlp_dim=0,mlp_dim=6", "data=2,tensor=4", 16, 32,
     "tensor=4 does not divide expert_mlp_dim (= mlp_dim)=6"),
    ("moe-tiny", "expert=8", 12, 32, "batch=12 is not divisible by the data-parallel size expert=8 (8)"),
])
def test_strategy_constraints(model, mesh, batch, seq, message):
    raises_naming(message, build, model, mesh, batch, seq)


def test_minus_one_fills_the_remaining_devices():
    assert build("llama-tiny", "data=4,tensor=-1").strategy.size("tensor") == 2


@pytest.mark.parametrize("spec, message", [
    ("data=2,model=4", "unknown mesh axis 'model'"),
    ("data=two", "size 'two' of data is not an integer"),
    ("data", "unknown mesh 'data'"),
    ("data=-1,tensor=-1", "only one axis may be -1"),
])
def test_mesh_spec_errors(spec, message):
    raises_naming(message, lambda: parse_strategy(spec).resolved(8))


def test_mesh_file_errors(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="mesh file .*nope.toml: no such file"):
        parse_strategy(str(missing))
    bad = tmp_path / "bad.toml"
    bad.write_text("[mesh\ndata = 2")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        parse_strategy(str(bad))
    wrong = tmp_path / "wrong.toml"
    wrong.write_text("[mesh]\ndata = 2\n[options]\nzero = 2\n")
    with pytest.raises(ConfigError, match="option zero=2 is not one of 0 | 1 | 3"):
        parse_strategy(str(wrong))
    typo = tmp_path / "typo.toml"
    typo.write_text("[mesh]\ndata = 8\n[options]\nsequence_paralel = true\n")
    with pytest.raises(ConfigError, match="unknown option 'sequence_paralel'"):
        parse_strategy(str(typo))


@pytest.mark.parametrize("spec, message", [
    ("llama-huge", "unknown model preset 'llama-huge'"),
    ("llama-tiny:layers", "malformed model override 'layers'"),
    ("llama-tiny:layerz=4", "unknown model field 'layerz'"),
    ("llama-tiny:layers=four", "layers='four' is not a valid int"),
    ("llama-tiny:heads=16,kv_heads=6", "kv_heads=6 does not divide heads=16"),
    ("moe-tiny:top_k=9", "top_k=9 must be <= experts=8"),
    ("llama-tiny:pattern=E", "experts must be >= 1 with 'E' in the pattern, got 0"),
    ("moe-tiny:capacity_factor=nan", "capacity_factor must be a finite number >= 0, got nan"),
])
def test_model_spec_errors(spec, message):
    raises_naming(message, parse_model, spec)


def test_zero_contradicting_the_mesh():
    with pytest.raises(ConfigError, match="zero=3 shards parameters over the fsdp axis, but the mesh has fsdp=1"):
        Trainer(parse_model("llama-tiny"), parse_strategy("data=8").with_options(zero=3), TrainConfig())
    with pytest.raises(ConfigError, match="zero=1 keeps parameters replicated, but the mesh has fsdp=8"):
        Trainer(parse_model("llama-tiny"), parse_strategy("fsdp=8").with_options(zero=1), TrainConfig())


def test_devices_after_jax_started():
    assert jax.device_count() == 8
    simulate_cpu_devices(8)  # same count: fine
    with pytest.raises(ConfigError, match="--devices 4 asked after JAX already started with 8 devices"):
        simulate_cpu_devices(4)


def test_device_flag_keeps_the_users_xla_flags():
    flags = with_device_count("--xla_cpu_use_thunk_runtime=false --xla_force_host_platform_device_count=2", 8)
    assert flags.split() == ["--xla_cpu_use_thunk_runtime=false", "--xla_force_host_platform_device_count=8"]


def test_cli_prints_the_error_without_a_traceback(capsys):
    code = cli.main(["train", "--model", "llama-tiny:heads=6,kv_heads=2", "--mesh", "data=2,tensor=4",
                     "--steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == "jaxpar: error: tensor=4 does not divide heads=6"
