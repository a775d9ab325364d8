"""Malformed input, every command: exit status 2, one line `jaxpar: error: ...` naming what is wrong,
no traceback, nothing compiled or trained.

The table is generated from the validation schema (every numeric flag of the parser, every model field,
every strategy option, every TOML table) with the bad values of its type, plus hand-written cases
for paths, config-file shapes and resources. Each case runs `jaxpar.cli.main.main` in this process, and
states the words its error must contain, so a case cannot pass by failing for another reason.
The same cases in fresh processes (where `--devices` and JAX start-up also run) are `slow`.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest

from jaxpar.cli import main as cli

from jaxpar.core import inputs
from jaxpar.models.config import ModelConfig
from jaxpar.core.strategy import OPTION_FIELDS

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASE = {  # a valid command line for each command; a case spoils one thing
    "train": ["train", "--model", "llama-tiny", "--mesh", "dp8", "--steps", "1", "--batch", "8", "--seq", "16",
              "--no-progress"],
    "estimate": ["estimate", "--model", "llama3-8b", "--mesh", "h100-node-tp8", "--hardware", "h100-sxm"],
    "plan": ["plan", "--model", "llama3-8b", "--hardware", "h100-sxm", "--devices", "64"],
    "comm": ["comm", "--model", "llama-tiny", "--mesh", "dp8"],
    "compare": ["compare", "--model", "llama-tiny", "--meshes", "dp8", "fsdp8"],
    "generate": ["generate", "--model", "llama-tiny", "--mesh", "dp8", "--prompt", "1,2,3"],
    "eval": ["eval", "--ckpt-dir", "ck", "--data", "data"],
    "export": ["export", "ck", "--to", "hf", "hf-out"],
    "launch": ["launch", "--processes", "2", "--", "train", "--model", "llama-tiny", "--mesh", "dp8"],
    "explain": ["explain", "attn.wq", "--model", "llama-tiny", "--mesh", "dp8"],
    "data": ["data", "--input", "README.md", "--output", "data-out", "--train-tokenizer", "--vocab", "300"],
    "schedule": ["schedule", "--pp-schedule", "zb-h1", "--stages", "4", "--microbatches", "8"],
}
BAD_INTEGERS = {"-1": "must be >", "abc": "is not an integer", "1.5": "is not an integer", "": "is not an integer"}
BAD_REALS = {"nan": "must be finite", "inf": "must be finite", "x": "is not a number", "-1": "must be >"}


def set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with `flag value` (replacing the flag's value if given, before any `--`)."""
    argv = list(argv)
    end = argv.index("--") if "--" in argv else len(argv)
    if flag in argv[:end]:
        argv[argv.index(flag) + 1] = value
        return argv
    return argv[:end] + [flag, value] + argv[end:]


def flag_cases():
    """Every flag whose parser type is one of jaxpar.core.inputs' number types, with its bad values."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    for command, p in sub.choices.items():
        for action in p._actions:  # noqa: SLF001
            flag = next((o for o in action.option_strings if o.startswith("--")), None)
            kind = getattr(action.type, "__name__", "")
            if flag is None or kind not in ("integer", "number") or action.choices:
                continue
            for value, words in (BAD_INTEGERS if kind == "integer" else BAD_REALS).items():
                yield pytest.param(set_flag(BASE[command], flag, value), [f"argument {flag}", words],
                                   id=f"{command}{flag}={value}")
            if action.type is inputs.POSITIVE:
                yield pytest.param(set_flag(BASE[command], flag, "0"), [f"argument {flag}", "must be >= 1, got 0"],
                                   id=f"{command}{flag}=0")


def model_cases():
    """Every numeric model field at zero and below (and NaN for floats), on the family that uses it
    (0 only where it is not a valid value: MoE fields where 0 means dropless, none or no loss)."""
    mamba = {"d_state", "d_conv", "expand", "ssm_head_dim", "ngroups", "chunk"}
    moe = {"experts", "top_k", "expert_mlp_dim", "shared_experts", "capacity_factor", "aux_loss_coef", "z_loss_coef"}
    deepseek = {"kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "routed_scaling_factor", "n_group",
                "topk_group", "router_bias_update"}   # latent attention, the group-limited router and its bias
    zero_is_valid = {"expert_mlp_dim", "shared_experts", "capacity_factor", "aux_loss_coef", "z_loss_coef",
                     "rope_scaling_factor",  # (0: no RoPE scaling; the other rope_* fields apply under a factor)
                     "kv_lora_rank", "q_lora_rank",   # 0: GQA; a full query projection
                     "router_bias_update",            # 0: the bias held
                     "mtp_depth", "mtp_weight",       # 0: no multi-token prediction; its loss unweighted
                     "rope_mscale", "rope_mscale_all_dim"}   # 0: YaRN's default attention factor
    for f in dataclasses.fields(ModelConfig):
        if f.type not in ("int", "float") or f.name in ("tie_embeddings",):
            continue
        preset = ("mamba2-tiny" if f.name in mamba else "moe-tiny" if f.name in moe
                  else "deepseek-tiny" if f.name in deepseek else "llama-tiny")
        if f.name.startswith("rope_") and f.name != "rope_scaling_factor" and f.name != "rope_theta":
            preset = "llama-tiny:rope_scaling_factor=8,"
        else:
            preset += ":"
        values = ("0", "-3") + (("nan", "inf") if f.type == "float" else ("two",))
        for value in values:
            if value == "0" and f.name in zero_is_valid:
                continue
            words = "is not a valid int" if value == "two" else f.name
            yield pytest.param(set_flag(BASE["train"], "--model", f"{preset}{f.name}={value}"), [words],
                               id=f"model-{f.name}={value}")


def option_cases():
    """Every strategy option with a value of the wrong kind, on the command line and in a mesh file."""
    for f in OPTION_FIELDS:
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            continue  # a switch: takes no value
        bad = "bogus" if f.metadata["choices"] and f.name != "zero" else "0" if f.name != "zero" else "2"
        # free text (pp_stages) is parsed where it is used (jaxpar.core.validate), which names the option
        free = isinstance(f.default, str) and not f.metadata["choices"]
        command = "train" if "train" in f.metadata["commands"] else f.metadata["commands"][0]   # one that takes it
        yield pytest.param(set_flag(BASE[command], flag, bad), [f.name if free else f"argument {flag}"],
                           id=f"flag{flag}={bad}")


def toml_option_cases(tmp: pathlib.Path):
    for f in OPTION_FIELDS:
        for value, words in (("\"bogus\"", f.name), ("[1, 2]", f.name), ("2.5", f.name)):
            if isinstance(f.default, bool) and value == "2.5":
                continue
            yield f"[mesh]\ndata = 8\n[options]\n{f.name} = {value}\n", [f.name]


MESH_FILES = [
    ("mesh = 3\n", "[mesh] must be a table"),
    ("[mesh]\ndata = \"8\"\n", "must be a positive integer"),
    ("[mesh]\ndata = 0\n", "must be a positive integer"),
    ("[mesh]\ndata = 2.0\n", "must be a positive integer"),
    ("[mesh]\ndata = true\n", "must be a positive integer"),
    ("[mesh]\nrows = 8\n", "unknown mesh axis 'rows'"),
    ("[mesh]\n", "needs a [mesh] table"),
    ("options = \"x\"\n[mesh]\ndata = 8\n", "[options] must be a table"),
    ("[mesh]\ndata = 8\ndcn = 2\n", "[dcn] must be a table"),
    ("description = 5\n[mesh]\ndata = 8\n", "description must be a string"),
    ("[mesh]\ndata = 8\n[extra]\n", "unknown table(s) extra"),
    ("[mesh\ndata = 8\n", "is not valid TOML"),
    ("[mesh]\ndata = 8\ndata = 4\n", "is not valid TOML"),
]
MODEL_FILES = [
    ("preset = 3\n", "preset must be a preset name"),
    ("preset = \"nope\"\n", "unknown model preset 'nope'"),
    ("preset = \"llama-tiny\"\nlayers = [2]\n", "layers=[2] must be an integer"),
    ("preset = \"llama-tiny\"\nwidth = 2\n", "unknown model field 'width'"),
    ("preset = \"llama-tiny\"\nnorm_eps = -1e-5\n", "norm_eps must be a positive finite number"),
    ("preset = \"llama-tiny\"\nrope_theta = nan\n", "rope_theta must be a positive finite number"),
    ("preset = \"llama-tiny\"\ntie_embeddings = 1\n", "must be true or false"),
    ("preset = \"llama-tiny\"\npattern = \"AX\"\n", "pattern must be"),
    ("layers = \n", "is not valid TOML"),
]
HARDWARE_FILES = [
    ("name = 3\n", "name must be a string"),
    ("device = [1]\n", "[device] must be a table"),
    ("[device]\npeak_flops = \"x\"\n", "peak_flops='x' must be a number"),
    ("[device]\npeak_flops = nan\n", "must be finite"),
    ("[device]\npeak_flops = -1.0\n", "must be >= 0"),
    ("[links]\ndevices_per_node = 8.5\n", "must be an integer"),
    ("[calibration]\ncalibrated = 1\n", "must be true or false"),
    ("[device]\npeak_flops = 1e15\n", "missing"),
    ("[gpu]\n", "unknown key(s) gpu"),
]


def file_cases(tmp: pathlib.Path):
    """Config files of the wrong shape, paths of the wrong kind, resources this host lacks."""
    n = 0

    def write(text: str | bytes, suffix: str) -> str:
        nonlocal n
        n += 1
        path = tmp / f"case{n}{suffix}"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return str(path)

    for text, words in MESH_FILES:
        yield set_flag(BASE["train"], "--mesh", write(text, ".toml")), [words]
    for text, words in toml_option_cases(tmp):
        yield set_flag(BASE["train"], "--mesh", write(text, ".toml")), words
    for text, words in MODEL_FILES:
        yield set_flag(BASE["train"], "--model", write(text, ".toml")), [words]
    for text, words in HARDWARE_FILES:
        yield set_flag(BASE["estimate"], "--hardware", write(text, ".toml")), [words]
    not_utf8 = write(b"[mesh]\ndata = \xff\n", ".toml")
    yield set_flag(BASE["train"], "--mesh", not_utf8), ["not UTF-8"]
    yield set_flag(BASE["train"], "--model", not_utf8), ["not UTF-8"]
    yield set_flag(BASE["estimate"], "--hardware", not_utf8), ["not UTF-8"]
    yield set_flag(BASE["train"], "--mesh", str(tmp / "missing.toml")), ["no such file"]
    yield set_flag(BASE["train"], "--model", str(tmp)) + [], ["unknown model preset"]
    # inline specs
    yield set_flag(BASE["train"], "--mesh", "data=2,data=4"), ["gives axis data twice"]
    yield set_flag(BASE["train"], "--mesh", "data=two"), ["is not an integer"]
    yield set_flag(BASE["train"], "--mesh", "data=2,tensor"), ["malformed mesh spec"]
    yield set_flag(BASE["train"], "--mesh", "nowhere"), ["unknown mesh 'nowhere'"]
    yield set_flag(BASE["train"], "--model", "llama-tiny:layers=2,layers=4"), ["sets layers twice"]
    yield set_flag(BASE["train"], "--model", "llama-tiny:layers"), ["malformed model override"]
    # data files
    empty = write(b"", ".bin")
    yield set_flag(BASE["train"], "--data", empty), ["is empty"]
    yield set_flag(BASE["train"], "--data", str(tmp)), ["is a directory"]
    yield set_flag(BASE["train"], "--data", str(tmp / "none.bin")), ["no such file"]
    fifo = tmp / "fifo"
    os.mkfifo(fifo)
    yield set_flag(BASE["train"], "--data", str(fifo)), ["not a regular file"]
    yield set_flag(BASE["train"], "--data", "/dev/zero"), ["not a regular file"]
    yield set_flag(BASE["train"], "--data", write(b"\x01", ".bin")), ["not a whole number"]
    # outputs
    a_file = write("x", ".txt")
    for command, flag in (("train", "--metrics"), ("estimate", "--json"), ("plan", "--json"), ("comm", "--json"),
                          ("compare", "--json")):
        yield set_flag(BASE[command], flag, str(tmp)), ["is a directory, not a file"]
        yield set_flag(BASE[command], flag, a_file + "/out.json"), ["is not a directory"]
    for flag in ("--tensorboard", "--profile"):
        yield set_flag(BASE["train"], flag, a_file), ["exists and is not a directory"]
    yield set_flag(BASE["compare"], "--plot", str(tmp)), ["must be a .png file name"]
    for flag in ("--metrics", "--data", "--ckpt-dir", "--tensorboard", "--profile"):
        yield set_flag(BASE["train"], flag, ""), [f"argument {flag}", "must not be empty"]
    # resources and ranges
    yield set_flag(BASE["train"], "--batch", str(2**31)), ["more than this host's"]
    yield set_flag(BASE["train"], "--model", "llama3-70b"), ["more than this host's"]
    yield set_flag(BASE["plan"], "--devices", "99999999999"), ["must be <= 1048576"]
    yield set_flag(BASE["train"], "--seed", str(2**31)), ["must be <= 2147483647"]
    yield set_flag(BASE["train"], "--seq", "100000"), ["seq=100000 must be between 1 and the model's max_seq"]
    yield BASE["train"] + ["--bogus"], ["unrecognized arguments: --bogus"]
    yield ["train", "--mesh", "dp8"], ["the following arguments are required: --model"]
    yield ["nonsense"], ["invalid choice: 'nonsense'"]
    yield ["launch", "--processes", "2"], ["launch needs a command after --"]
    yield ["launch", "--processes", "2", "--", "launch"], ["launch cannot launch itself"]
    yield set_flag(BASE["launch"], "--processes", "10000"), ["at most 64 local processes"]
    yield set_flag(BASE["launch"], "--devices-per-process", "4096"), ["XLA:CPU simulates at most 2048"]


CASES = [*flag_cases(), *model_cases(), *option_cases()]


def assert_clean_error(code: int, err: str, words: list[str]) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("jaxpar: error: "), err
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.mark.parametrize("argv, words", CASES)
def test_malformed_flag_values(argv, words, capsys):
    assert_clean_error(cli.main(argv), capsys.readouterr().err, words)


def test_malformed_files_paths_and_resources(tmp_path, capsys):
    """Each case in turn (one test: the files are written once); every failure is listed at the end."""
    failures, count = [], 0
    for argv, words in file_cases(tmp_path):
        count += 1
        try:
            assert_clean_error(cli.main(argv), capsys.readouterr().err, words)
        except AssertionError as e:
            failures.append(f"{argv}: {e}")
    assert failures == [], "\n".join(failures)
    assert count >= 90


def test_the_generated_table_covers_the_schema():
    assert len(CASES) >= 100  # with the file cases (>= 90), over 190 malformed inputs
    ids = {c.id for c in CASES}
    assert {"train--steps=0", "plan--devices=abc", "launch--grace=nan", "model-mlp_dim=0", "model-d_state=-3",
            "model-rope_theta=nan", "flag--pp-schedule=bogus"} <= ids


@pytest.mark.slow
@pytest.mark.parametrize("argv, words", CASES[::4])
def test_in_a_fresh_process(argv, words):
    out = subprocess.run([sys.executable, "-m", "jaxpar.cli.main", *argv], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert_clean_error(out.returncode, out.stderr, words)


def test_too_many_simulated_devices_in_a_fresh_process():
    """--devices beyond what XLA:CPU can create is refused before JAX starts (it used to abort in XLA)."""
    out = subprocess.run([sys.executable, "-m", "jaxpar.cli.main", *BASE["train"], "--devices", "20000"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert_clean_error(out.returncode, out.stderr, ["--devices 20000", "at most 2048"])
