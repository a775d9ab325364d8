"""`jaxpar data` (jaxpar/training/corpus.py): text in, shards and a manifest out, checked by reading the
shards back through the tokenizer; every bad input refused in one line naming the file and the rule."""
import json
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxpar.cli.main import main
from jaxpar.errors import ConfigError
from jaxpar.training import corpus, loader
from jaxpar.training import tokenizer as tokenizers
from jaxpar.training.data import TokenFile, local_batch


def texts(n: int = 30) -> list[str]:
    """Documents of varied length (one with non-ASCII text)."""
    return [f"def f{i}(x):\n    return x * {i} + {i * i}  # é\n" * (1 + i % 4) for i in range(n)]


def small_tokenizer(docs: list[str], path: pathlib.Path, vocab: int = 200) -> pathlib.Path:
    """A byte-level BPE over the corpus's own bytes only, so that it fits llama-tiny's 256 ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=vocab, special_tokens=[tokenizers.EOT],
                                                      show_progress=False))
    tok.save(str(path))
    return path


def write_inputs(root: pathlib.Path, docs: list[str]) -> pathlib.Path:
    """The documents spread over the three input formats in one folder: text files, JSON lines, Parquet."""
    folder = root / "in"
    (folder / "sub").mkdir(parents=True)
    for i, d in enumerate(docs[:10]):
        (folder / "sub" / f"doc{i:02d}.txt").write_text(d)
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[10:20])))
    pq.write_table(pa.table({"text": docs[20:]}), folder / "docs.parquet")
    (folder / "ignored.bin").write_bytes(b"\0\1")  # unknown suffix in a folder: not read
    return folder


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = texts()
    tok = small_tokenizer(docs, root / "tok.json")
    corpus.prepare([str(write_inputs(root, docs))], str(root / "data"), tokenizer=str(tok), val_fraction=0.2,
                   progress=False)
    return root / "data", docs


def shard_documents(data: pathlib.Path, split: str) -> list[str]:
    """The documents of a split read back from its shards and index, each checked to end with the separator."""
    m = json.loads((data / "manifest.json").read_text())
    tok = tokenizers.load(str(data))
    out = []
    for shard in m["splits"][split]["shards"]:
        ids = np.fromfile(data / shard["path"], dtype=m["dtype"])
        ends = np.load(data / shard["index"])
        assert len(ids) == shard["tokens"] == ends[-1] and len(ends) == shard["documents"]
        assert corpus.sha256(data / shard["path"]) == shard["sha256"]
        for start, end in zip(np.concatenate([[0], ends[:-1]]), ends):
            assert ids[end - 1] == m["eot"]
            out.append(tok.decode(ids[start:end - 1]))
    return out


def test_prepared_corpus_round_trips(prepared):
    data, docs = prepared
    m = json.loads((data / "manifest.json").read_text())
    train, val = shard_documents(data, "train"), shard_documents(data, "val")
    assert sorted(train + val) == sorted(docs)  # every document, whole, in exactly one split
    assert len(val) == round(0.2 * len(docs)) == m["splits"]["val"]["documents"]
    assert len(train) == m["splits"]["train"]["documents"]
    assert m["vocab"] == tokenizers.load(str(data)).vocab <= 256 and m["dtype"] == "uint16"
    assert len(m["inputs"]) == 12 and not any(p.endswith(".bin") for p in m["inputs"])
    assert not [p for p in data.parent.iterdir() if ".partial-" in p.name]  # the temporary directory is gone


def test_trained_tokenizer_round_trips_any_text(tmp_path):
    docs = ["naïve café\n\ttabs", "日本語 text", "plain"] * 5
    tok = tokenizers.train(docs, 300)
    for d in docs[:3] + ["bytes never seen: ß€\x7f"]:
        assert tok.decode(tok.encode(d)) == d


def test_data_command_reports_counts(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello world\n" * 20)
    (tmp_path / "b.txt").write_text("goodbye world\n" * 20)
    assert main(["data", "--input", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--output",
                 str(tmp_path / "out"), "--train-tokenizer", "--vocab", "270", "--val-fraction", "0.5",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "train: 1 documents" in out and "val: 1 documents" in out and "tokens/s" in out


def one_line_error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("case, expected", [
    ("empty-folder", "an empty folder"),
    ("binary", "a binary file"),
    ("not-utf8", "not UTF-8"),
    ("no-text-field", "line 2: no 'text' string field"),
    ("empty-files", "no text"),
    ("missing", "no such file"),
    ("parquet-numbers", "row 0: the 'text' column holds int"),
])
def test_bad_input_is_one_line_naming_the_file(tmp_path, capsys, case, expected):
    bad = tmp_path / case
    if case == "empty-folder":
        bad.mkdir()
        (bad / "notes.bin").write_bytes(b"x")
    elif case == "binary":
        bad = tmp_path / "x.txt"
        bad.write_bytes(b"text\0\1\2")
    elif case == "not-utf8":
        bad = tmp_path / "x.txt"
        bad.write_bytes(b"caf\xe9")
    elif case == "no-text-field":
        bad = tmp_path / "x.jsonl"
        bad.write_text('{"text": "a"}\n{"body": "b"}\n')
    elif case == "parquet-numbers":
        bad = tmp_path / "x.parquet"
        pq.write_table(pa.table({"text": [1, 2]}), bad)
    elif case == "empty-files":
        bad = tmp_path / "x.txt"
        bad.write_text("")
    err = one_line_error(["data", "--input", str(bad), "--output", str(tmp_path / "out"), "--train-tokenizer",
                          "--vocab", "300", "--no-progress"], capsys)
    assert str(bad) in err and expected in err, err
    assert not (tmp_path / "out").exists()


def test_a_failed_run_leaves_no_half_dataset(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("some text\n" * 50)

    def broken(*args):
        raise OSError("disk full")

    monkeypatch.setattr(corpus, "write_split", broken)
    with pytest.raises(OSError):
        corpus.prepare([str(tmp_path / "a.txt")], str(tmp_path / "out"), vocab=300, val_fraction=0, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_manifest_checks_before_training(prepared, tmp_path):
    data, _ = prepared
    with pytest.raises(ConfigError, match=r"vocabulary \(\d+ ids\) exceeds the model's vocab=64"):
        loader.Dataset(str(data), vocab=64)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in data.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    shard = next(copy.glob("train-*.bin"))
    raw = bytearray(shard.read_bytes())
    raw[0] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=f"{shard}: sha256 does not match"):
        loader.Dataset(str(copy), vocab=256)
    source = loader.PreparedSource(loader.Dataset(str(data), vocab=256), "val", 0, batch=2)
    with pytest.raises(ConfigError, match="too few for one sequence"):
        source.rows(0, [0], 10 ** 6)


def test_raw_token_files_state_their_width_and_ids_are_checked(tmp_path):
    ids = np.arange(300, dtype=np.uint16) % 200
    ids[123] = 250
    for name in ("t.bin", "t.u16.bin"):
        ids.tofile(tmp_path / name)
    with pytest.raises(ConfigError, match="does not state its token width"):
        TokenFile(str(tmp_path / "t.bin"), vocab=256)
    (tmp_path / "t.u32.bin").write_bytes(ids.astype(np.uint32).tobytes())
    wide = TokenFile(str(tmp_path / "t.u32.bin"), vocab=256)
    np.testing.assert_array_equal(wide.tokens, ids)  # read at its own width, whatever the vocabulary
    with pytest.raises(ConfigError, match=r"token id 250 at position 123 .* vocab=200"):
        for step in range(50):
            local_batch(TokenFile(str(tmp_path / "t.u16.bin"), vocab=200), step, range(4), 64)


def test_text_prompts_use_the_data_directory_tokenizer(prepared, capsys, tmp_path):
    data, _ = prepared
    tok = tokenizers.load(str(data))
    assert tok.decode(tok.encode("def f3(x):")) == "def f3(x):"
    err = one_line_error(["generate", "--model", "llama-tiny", "--mesh", "dp8", "--prompt-text", "def f"], capsys)
    assert "--prompt-text needs --tokenizer" in err
    err = one_line_error(["generate", "--model", "llama-tiny", "--mesh", "dp8", "--prompt", "1,2",
                          "--tokenizer", str(data)], capsys)
    assert "--tokenizer" in err and "is for --prompt-text" in err
    out = tmp_path / "g.json"
    assert main(["generate", "--model", "llama-tiny", "--mesh", "tensor=8", "--prompt-text", "def f", "--tokenizer",
                 str(data), "--max-new-tokens", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["text"] == [{"prompt": "def f", "continuation": tok.decode(report["tokens"][0])}]
