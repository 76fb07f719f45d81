"""The package's word rule: one token per word or punctuation mark, lower-cased. The tokenizer
(``models.common.HashWordTokenizer``) encodes these words and the reasoning templates are
written and compared in them, so both follow this one rule."""

from __future__ import annotations

import re

_WORDS = re.compile(r"\w+|[^\w\s]", re.UNICODE)


def words_of(text: str) -> list[str]:
    return _WORDS.findall(text.lower())
