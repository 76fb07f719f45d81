"""A tokenizer for a SmolVLA trained here from scratch (``vla-accel train --family smolvla``).

A pretrained SmolVLA reads its task through SmolVLM's tokenizer (49,280 ids), which cannot be
downloaded here and which a policy trained from random weights does not need. A trained bundle
brings its own: a byte-level BPE (SmolLM2's scheme, built with the ``tokenizers`` library) over
the instructions it was trained on, with SmolVLM's special tokens, so that any text encodes
(unseen words fall back to bytes) and LeRobot's SmolVLA loads it unchanged from the exported
SmolVLM directory (``vla-accel bundle export-lerobot``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 as in SmolLM2
IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")


def build_tokenizer(texts: Iterable[str], vocab_size: int):
    """A ``PreTrainedTokenizerFast`` of at most ``vocab_size`` ids, trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = sorted({t.strip() + "\n" for t in texts if t.strip()})  # the prompt as SmolVLA passes it
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # The byte alphabet and the special tokens are always in; merges fill the rest.
    size = min(vocab_size - len(IMAGE_TOKENS), 256 + len(SPECIAL) + 8 * sum(len(t) for t in corpus))
    trainer = trainers.BpeTrainer(
        vocab_size=size, special_tokens=list(SPECIAL), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<end_of_utterance>", pad_token="<|im_end|>",
        unk_token="<|endoftext|>", model_max_length=8192,
        extra_special_tokens={
            "fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
            "end_of_utterance_token": "<end_of_utterance>", "global_image_token": "<global-img>",
        },
    )  # fmt: skip
    fast.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    if len(fast) > vocab_size:
        raise ValueError(f"the tokenizer needs {len(fast)} ids, more than the text model's vocab_size={vocab_size}")
    return fast


def write_tokenizer(out: str | Path, texts: Iterable[str], vocab_size: int) -> Path:
    """Build the tokenizer for ``texts`` and save it (transformers' files) into ``out``."""
    out = Path(out)
    build_tokenizer(texts, vocab_size).save_pretrained(str(out))
    return out
