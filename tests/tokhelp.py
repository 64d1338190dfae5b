"""A tiny real Hugging Face tokenizer folder for the overlay tests (the fixtures carry no tokenizer, like every
Cerebras checkpoint): a word-level tokenizer over ``w4 … w127`` with chosen special token ids and a chat template,
saved by transformers' own ``save_pretrained``."""
from __future__ import annotations

from pathlib import Path


def make_tokenizer(folder: Path, *, pad: int = 0, bos: int = 1, eos: int = 2, unk: int = 3, vocab_size: int = 128,
                   with_generation_config: dict | None = None) -> Path:
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = {"<pad>": pad, "<s>": bos, "</s>": eos, "<unk>": unk}
    taken = set(special.values())
    vocab = {f"w{i}": i for i in range(vocab_size) if i not in taken}
    vocab.update(special)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    if with_generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(with_generation_config))
    return folder


def prompts(n: int = 8, length: int = 6, vocab_size: int = 128, seed: int = 3) -> list:
    """``n`` prompts of word tokens (ids 4..vocab_size-1) as text for the tokenizer above."""
    import random

    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(4, vocab_size)}" for _ in range(length)) for _ in range(n)]
