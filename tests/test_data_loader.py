"""Training on prepared text (jaxpar/training/loader.py): batches as a pure function of (seed, step, row),
so resuming is going to a step and processes read disjoint rows; real tokens train every strategy to the
1-device numbers; the held-out loss is a plain forward's; document masking is each document alone.
The second strategy and the blockwise-kernel case of document masking run under -m slow."""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.cli.main import main
from jaxpar.errors import ConfigError
from jaxpar.models.config import parse_model
from jaxpar.core.strategy import parse_inline
from jaxpar.models.lm import LM
from jaxpar.training import corpus, loader
from jaxpar.training.data import local_batch, process_indices
from jaxpar.training.trainer import gather, run_config
from tests import harness
from tests.test_data_prepare import small_tokenizer, texts

MODEL = "llama-tiny"  # 256 ids: the test tokenizer's 200 fit
BATCH, SEQ = harness.TC.batch, harness.TC.seq


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    docs = texts(60)
    (root / "in").mkdir()
    for i, d in enumerate(docs):
        (root / "in" / f"{i:02d}.txt").write_text(d)
    tok = small_tokenizer(docs, root / "tok.json")
    corpus.prepare([str(root / "in")], str(root / "data"), tokenizer=str(tok), val_fraction=0.2, progress=False)
    return root / "data"


def source(data, split="train", **kw):
    return loader.PreparedSource(loader.Dataset(str(data), 256), split, seed=7, batch=BATCH, **kw)


def test_resumed_run_reads_bitwise_the_same_batches(data):
    """Steps 5..9 of a fresh source (a run resumed at step 5, in a new process) equal those of the
    uninterrupted run; within an epoch no sequence repeats, and the next epoch is another permutation."""
    run = source(data)
    whole = [local_batch(run, step, range(BATCH), SEQ) for step in range(10)]
    resumed = source(data)
    for step in range(5, 10):
        for key, value in local_batch(resumed, step, range(BATCH), SEQ).items():
            np.testing.assert_array_equal(value, whole[step][key])
    epoch = loader.PackedSequences(run.data.shards("train"), SEQ)
    n = len(epoch)
    order = [tuple(run.dataset(SEQ)[i]) for i in range(2 * n)]
    every = sorted(tuple(epoch[i]) for i in range(n))
    assert sorted(order[:n]) == every == sorted(order[n:])  # each epoch: every sequence once
    assert order[:n] != order[n:]  # epoch 2 in another order


def test_batches_are_the_same_on_any_mesh(data):
    """The global batch of a step, gathered, is the same under any strategy (a run resumed on another mesh
    continues with the batches the first would have read)."""
    want = local_batch(source(data), 4, range(BATCH), SEQ)
    for mesh in ("fsdp8", "dp2-tp4"):
        got = gather(harness.trainer(MODEL, mesh).batch(source(data), 4))
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{mesh} {key}")


def test_processes_read_disjoint_rows_whose_union_is_the_batch(data):
    """Two processes of a dp8 run (devices 0-3 and 4-7), each reading only its rows, feed exactly the
    rows of the batch one process reads."""
    tr = harness.trainer(MODEL, "dp8")
    src = source(data)
    full = local_batch(src, 3, range(BATCH), SEQ)
    seen = []
    for process in (0, 1):
        rows, _ = process_indices(tr.batch_sharding, (BATCH, SEQ), process, lambda d: d.id // 4)
        part = local_batch(source(data), 3, rows, SEQ)
        np.testing.assert_array_equal(part["inputs"], full["inputs"][rows])
        seen += list(rows)
    assert sorted(seen) == list(range(BATCH))


@functools.cache
def real_loss_and_grads(data, mesh: str, devices: int = 8):
    tr = harness.trainer(MODEL, mesh, devices)
    loss, grads = tr.loss_and_grads(tr.state_from_params(harness.reference_params(MODEL)).params,
                                    tr.batch(source(data), 2))
    return float(loss), dict(harness.leaves_with_paths(gather(grads)))


@pytest.mark.parametrize("mesh", ["fsdp8", pytest.param("dp2-tp4", marks=pytest.mark.slow)])
def test_strategies_on_real_tokens_equal_one_device(data, mesh):
    """Loss and gradients of a real-text batch under a strategy equal the 1-device run's."""
    ref_loss, ref_grads = real_loss_and_grads(data, "data=1", 1)
    loss, grads = real_loss_and_grads(data, mesh)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for path, g in grads.items():
        np.testing.assert_allclose(g, ref_grads[path], rtol=1e-5, atol=1e-5 * np.abs(ref_grads[path]).max(),
                                   err_msg=f"{mesh} {path}")


def test_eval_loss_equals_a_plain_forward(data):
    """The sharded eval step's loss over K held-out batches equals a plain one-device forward of them."""
    tr = harness.trainer(MODEL, "fsdp8")
    state = tr.state_from_params(harness.reference_params(MODEL))
    held = source(data, "val", shuffle=False)
    got = tr.evaluate(state, held, 2)
    model = nnx.merge(tr.graphdef, harness.reference_params(MODEL))
    plain = np.mean([float(model(jnp.asarray(b["inputs"]), jnp.asarray(b["positions"]), jnp.asarray(b["labels"])))
                     for b in (local_batch(held, k, range(BATCH), SEQ) for k in range(2))])
    np.testing.assert_allclose(got["eval_loss"], plain, rtol=1e-5)
    np.testing.assert_allclose(got["eval_ppl"], np.exp(plain), rtol=1e-5)


@pytest.mark.parametrize("kernel, remat", [("dense", "none"),
                                           pytest.param("blockwise", "selective", marks=pytest.mark.slow)])
def test_document_masked_model_equals_each_document_alone(data, kernel, remat):
    """The model's output over a packed row with the loader's segment ids and per-document positions
    equals the model run on each document alone."""
    src = source(data)
    src.document_mask = True
    batch = next(b for b in (local_batch(src, 0, [row], SEQ) for row in range(BATCH))
                 if len(np.unique(b["segments"])) > 2)
    run = run_config(parse_inline("data=1").with_options(attention_kernel=kernel, remat=remat))
    model = nnx.merge(*nnx.split(LM(parse_model(MODEL), run, rngs=nnx.Rngs(0))))
    run = jax.jit(lambda t, p, s: model.apply_stack_aux(model.embed(t), p, s)[0])
    packed = run(*(jnp.asarray(batch[k]) for k in ("inputs", "positions", "segments")))
    segments = batch["segments"][0]
    for seg in np.unique(segments):
        idx = np.flatnonzero(segments == seg)
        alone = model.apply_stack(model.embed(jnp.asarray(batch["inputs"][:, idx])), jnp.asarray(batch["positions"][:, idx]))
        np.testing.assert_allclose(packed[0, idx], alone[0], rtol=2e-5, atol=2e-5)


def test_document_mask_is_refused_where_documents_would_mix():
    tr = harness.trainer(MODEL, "cp8-ring")
    with pytest.raises(ConfigError, match="--document-mask: context-parallel attention takes no segment ids"):
        tr.use_document_mask()
    tr = harness.trainer("deepseek-tiny", "dp8")
    with pytest.raises(ConfigError, match="--document-mask: model deepseek-tiny's multi-token prediction modules"):
        tr.use_document_mask()


def test_train_flags_on_prepared_data_are_checked_before_compiling(data, capsys):
    common = ["train", "--model", MODEL, "--mesh", "dp8", "--data", str(data)]
    assert main(common + ["--seq", "512"]) == 2
    err = capsys.readouterr().err
    assert "max_seq" in err and len(err.strip().splitlines()) == 1
    assert main(common[:2] + ["llama-tiny:vocab=128"] + common[3:]) == 2
    assert "exceeds the model's vocab=128" in capsys.readouterr().err


def test_eval_flags_need_held_out_text(capsys):
    assert main(["train", "--model", MODEL, "--mesh", "dp8", "--eval-every", "5"]) == 2
    err = capsys.readouterr().err
    assert "--eval-every 5 needs held-out text" in err and len(err.strip().splitlines()) == 1
    assert main(["train", "--model", MODEL, "--mesh", "dp8", "--document-mask"]) == 2
    assert "--document-mask needs prepared data" in capsys.readouterr().err


def train_losses(data, tmp, name: str, mesh: str, *extra: str) -> dict[int, float]:
    """Losses by step of `jaxpar train --data` on prepared text (6 steps, a checkpoint every 3)."""
    metrics = tmp / f"{name}.jsonl"
    argv = ["train", "--model", MODEL, "--mesh", mesh, "--data", str(data), "--steps", "6", "--batch", str(BATCH),
            "--seq", str(SEQ), "--no-progress", "--metrics", str(metrics), *extra]
    assert main(argv) == 0
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())}


def test_eval_of_a_checkpoint_on_another_mesh_is_the_runs_own_eval_loss(data, tmp_path, capsys):
    """`jaxpar eval` reads the model (and, without --data, the data directory) from the checkpoint and
    restores it read-only onto fsdp8: its held-out loss is the one `train --eval-every` logged at that step
    on dp8 (float32 resharding: 1e-5); generate takes the model and the tokenizer from the checkpoint."""
    ck, out = tmp_path / "ck", tmp_path / "eval.json"
    train_losses(data, tmp_path, "run", "dp8", "--ckpt-dir", str(ck), "--eval-every", "6", "--eval-batches", "2")
    logged = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()][-1]
    capsys.readouterr()
    before = sorted((str(p), p.stat().st_mtime_ns) for p in ck.rglob("*"))
    assert main(["eval", "--ckpt-dir", str(ck), "--data", str(data), "--mesh", "fsdp8", "--batch", str(BATCH),
                 "--seq", str(SEQ), "--eval-batches", "2", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["step"] == logged["step"] == 6 and got["model"] == MODEL
    assert got["eval_loss"] == pytest.approx(logged["eval_loss"], rel=1e-5)
    assert f"step 6: eval_loss {got['eval_loss']:.4f}" in capsys.readouterr().out
    assert sorted((str(p), p.stat().st_mtime_ns) for p in ck.rglob("*")) == before  # read-only
    assert main(["eval", "--ckpt-dir", str(ck), "--mesh", "dp8", "--batch", str(BATCH), "--seq", str(SEQ),
                 "--eval-batches", "2", "--json", str(out)]) == 0  # --data: the run's own, from the checkpoint
    assert json.loads(out.read_text())["eval_loss"] == pytest.approx(logged["eval_loss"], rel=1e-5)
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(ck), "--mesh", "tensor=8", "--prompt-text", "def f",
                 "--max-new-tokens", "2", "--json", str(out)]) == 0  # model and tokenizer from the checkpoint
    assert json.loads(out.read_text())["text"][0]["prompt"] == "def f"
    assert main(["eval", "--ckpt-dir", str(tmp_path / "none"), "--data", str(data)]) == 2
    assert f"--ckpt-dir {tmp_path / 'none'}: no such directory" in capsys.readouterr().err


@pytest.mark.parametrize("mesh", ["dp8", pytest.param("fsdp8", marks=pytest.mark.slow)])
def test_stopped_run_on_text_resumes_bitwise(data, tmp_path, mesh):
    """A run on prepared text stopped after step 3 and resumed (on dp8, or restored onto fsdp8) continues
    with the uninterrupted run's batches: its losses equal the uninterrupted run's, bitwise on the same
    mesh, within resharding's float32 rounding on another."""
    whole = train_losses(data, tmp_path, "whole", "dp8")
    ck = ["--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "3"]
    train_losses(data, tmp_path, "first", "dp8", *ck, "--stop-after", "3")
    resumed = train_losses(data, tmp_path, "resumed", mesh, *ck, "--resume")
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        if mesh == "dp8":
            assert resumed[step] == whole[step], (step, resumed[step], whole[step])
        else:
            assert resumed[step] == pytest.approx(whole[step], rel=1e-5), step
