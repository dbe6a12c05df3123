"""Tokenizers the library ships itself: ``ByteTokenizer`` for tiny random models.

Tiny random models (``{kind: tiny}`` in ``decoding.models``) come without a tokenizer; with a
vocabulary of at least 256 ids they can take text as UTF-8 bytes. The tuner
(``tuner.config.build``) and EAGLE head training (``eagle_training``) both use this one.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ByteTokenizer"]


class ByteTokenizer:
    """UTF-8 bytes as tokens, for tiny random models (vocab ≥ 256) that have no tokenizer."""

    chat_template = None

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")
