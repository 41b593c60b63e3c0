"""Tokenizer wrapper: text <-> ids, chat template, the set of end-of-sequence ids."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InvalidParameterError

_EOS_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|end|>")


@dataclass
class Tokenizer:
    hf: object  # transformers PreTrainedTokenizerFast
    eos_ids: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_hf(cls, tok) -> "Tokenizer":
        ids = set()
        if tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
        vocab = tok.get_vocab()
        for name in _EOS_NAMES:  # chat models end turns with these even when eos_token says otherwise
            if name in vocab and name in (tok.all_special_tokens or []) + list(tok.added_tokens_encoder):
                ids.add(int(vocab[name]))
        return cls(tok, frozenset(ids))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat(self, messages: list[dict]) -> list[int]:
        if not self.has_chat_template:
            raise InvalidParameterError("this model has no chat template; drop --chat")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.hf.encode(text, add_special_tokens=False))

    def vocab_signature(self) -> dict[str, int]:
        return self.hf.get_vocab()
