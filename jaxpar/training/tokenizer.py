"""Text to token ids and back: a Hugging Face `tokenizers` tokenizer, loaded or trained on a corpus.

`load` reads a `tokenizer.json` (a file, or an HF checkpoint directory holding one); `train` builds a
byte-level BPE of a given vocabulary size on the corpus itself (GPT-2's scheme: every byte is in the
base alphabet, so any UTF-8 text encodes and decodes back exactly). Documents are separated by an
end-of-text token: the tokenizer's own (`<|endoftext|>`, `</s>`, `<|end_of_text|>`, `<eos>`), or, for a
trained one, `<|endoftext|>` added as its one special token.
"""
from __future__ import annotations

import pathlib
from collections.abc import Iterable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxpar.errors import ConfigError

EOT = "<|endoftext|>"
EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>")
MIN_TRAINED_VOCAB = 257  # the 256 byte symbols and the end-of-text token


class Tokenizer:
    """A `tokenizers.Tokenizer` with the end-of-text id the packed data separates documents with."""

    def __init__(self, tok: HFTokenizer, source: str):
        self.tok, self.source = tok, source
        eot = next((t for t in EOT_NAMES if tok.token_to_id(t) is not None), None)
        if eot is None:
            raise ConfigError(f"tokenizer {source}: no end-of-text token (one of {', '.join(EOT_NAMES)}) to "
                              "separate documents with")
        self.eot_token, self.eot = eot, tok.token_to_id(eot)

    @property
    def vocab(self) -> int:
        """Ids run 0 .. vocab - 1 (special tokens included)."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text, without special tokens; `tokenizers` encodes the batch on all cores."""
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        """The text of `ids`; the end-of-text token reads as itself."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | pathlib.Path) -> None:
        self.tok.save(str(path))


def load(path: str) -> Tokenizer:
    """The tokenizer of a `tokenizer.json` file or of a directory holding one (an HF checkpoint's)."""
    p = pathlib.Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        where = f"{path} holds no tokenizer.json" if p.is_dir() else f"{path}: no such file"
        raise ConfigError(f"--tokenizer {where}")
    try:
        tok = HFTokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for malformed JSON
        raise ConfigError(f"--tokenizer {file}: not a Hugging Face tokenizer.json ({str(e).splitlines()[0]})") from None
    return Tokenizer(tok, str(file))


def train(texts: Iterable[str], vocab: int) -> Tokenizer:
    """A byte-level BPE of `vocab` ids (the end-of-text token included) trained on `texts`."""
    if vocab < MIN_TRAINED_VOCAB:
        raise ConfigError(f"--vocab {vocab}: a byte-level BPE needs at least {MIN_TRAINED_VOCAB} ids (256 bytes "
                          "and the end-of-text token)")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return Tokenizer(tok, f"byte-level BPE trained on the corpus (vocab {vocab})")
