"""Tokenizer wrapper: text <-> ids, chat template, the set of end-of-sequence ids.

Encoding and decoding run on the Rust ``tokenizers`` object read straight from ``tokenizer.json`` —
what transformers' fast tokenizers delegate to — so start-up does not pay for importing transformers and
building its tokenizer (about 3 s of a 1.5B model's start). The transformers tokenizer is loaded on first
need only: rendering a chat template (exactly transformers' ``apply_chat_template``). A folder whose
config asks transformers for extra behaviour (adding BOS/EOS outside the post-processor, cleaning up
spaces) is loaded through transformers from the start.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..digest import sha256_file
from ..errors import InvalidParameterError

_EOS_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|end|>")


_HF_LOAD = threading.Lock()
_RUST_LOAD = threading.Lock()
_RUST: dict[str, object] = {}  # sha256 of a tokenizer.json -> its Rust tokenizer, read once per process


def _rust_tokenizer(tok_file: Path):
    """The Rust tokenizer of ``tok_file``, shared by every folder holding the same bytes: a draft model of
    the target's family (Qwen2.5 0.5B / 1.5B) reuses the target's instead of parsing 11 MB of JSON again
    (~0.5-0.8 s), and a draft with the very same tokenizer object needs no vocabulary comparison
    (``check_compatible``). Nothing in draftwise changes a tokenizer after loading it."""
    from tokenizers import Tokenizer as RustTokenizer

    key = sha256_file(tok_file)
    with _RUST_LOAD:
        if key not in _RUST:
            _RUST[key] = RustTokenizer.from_file(str(tok_file))
        return _RUST[key]


def _token_text(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


@dataclass
class Tokenizer:
    fast: object  # tokenizers.Tokenizer
    eos_ids: frozenset[int] = field(default_factory=frozenset)
    folder: Path | None = None  # where the transformers tokenizer loads from, when needed
    _hf: object | None = None  # transformers PreTrainedTokenizerFast, loaded on first need
    chat_template: str | None = None

    @classmethod
    def from_hf(cls, tok) -> "Tokenizer":
        ids = set()
        if tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
        vocab = tok.get_vocab()
        for name in _EOS_NAMES:  # chat models end turns with these even when eos_token says otherwise
            if name in vocab and name in (tok.all_special_tokens or []) + list(tok.added_tokens_encoder):
                ids.add(int(vocab[name]))
        fast = getattr(tok, "backend_tokenizer", None) or _PythonTokenizer(tok)
        return cls(fast, frozenset(ids), None, tok, getattr(tok, "chat_template", None))

    @classmethod
    def from_folder(cls, folder: Path) -> "Tokenizer":
        """The lean path (tokenizer.json + tokenizer_config.json + chat template), else transformers."""
        folder = Path(folder)
        cfg_file, tok_file = folder / "tokenizer_config.json", folder / "tokenizer.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else None
        if cfg is None or not tok_file.is_file() or any(cfg.get(k) for k in (
                "add_bos_token", "add_eos_token", "clean_up_tokenization_spaces", "auto_map")):
            from transformers import AutoTokenizer

            return cls.from_hf(AutoTokenizer.from_pretrained(str(folder)))
        fast = _rust_tokenizer(tok_file)
        special = {t.content for t in fast.get_added_tokens_decoder().values() if t.special}
        ids = set()
        eos = _token_text(cfg.get("eos_token"))
        if eos is not None and fast.token_to_id(eos) is not None:
            ids.add(fast.token_to_id(eos))
        for name in _EOS_NAMES:
            if name in special and fast.token_to_id(name) is not None:
                ids.add(fast.token_to_id(name))
        template = cfg.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        return cls(fast, frozenset(ids), folder, None, template)

    @property
    def hf(self):
        """The transformers tokenizer (chat templates), loaded on first use, once: concurrent first chat
        requests of a server wait for one load (two threads importing transformers at once can see a
        half-initialised module)."""
        if self._hf is None:
            with _HF_LOAD:
                if self._hf is None:
                    from transformers import AutoTokenizer

                    self._hf = AutoTokenizer.from_pretrained(str(self.folder))
        return self._hf

    @property
    def vocab_size(self) -> int:
        return self.fast.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.fast.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.fast.decode(list(ids), skip_special_tokens=skip_special)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat(self, messages: list[dict]) -> list[int]:
        if not self.has_chat_template:
            raise InvalidParameterError("this model has no chat template; drop --chat")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.fast.encode(text, add_special_tokens=False).ids

    def vocab_signature(self) -> dict[str, int]:
        return self.fast.get_vocab(with_added_tokens=True)


class _Encoding:
    def __init__(self, ids: list[int]):
        self.ids = ids


class _PythonTokenizer:
    """The calls ``Tokenizer`` makes on a Rust ``tokenizers.Tokenizer``, served by a transformers tokenizer
    that has none (a Python SentencePiece one: Marian's ``MarianTokenizer``)."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str, add_special_tokens: bool = True) -> _Encoding:
        return _Encoding(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self.tok)

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return self.tok.get_vocab()
