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


def make_llama_bpe_tokenizer(folder: Path, vocab_size: int = 128) -> Path:
    """A tiny Llama-style tokenizer (byte-fallback BPE over ``▁`` + a-z, 0-9, with ``<unk>``, ``<s>``, ``</s>`` = 0, 1,
    2) of ``vocab_size`` tokens, saved by transformers' ``save_pretrained``: one llama.cpp's converter reads as a
    Llama tokenizer (``tokenizer.json`` of type BPE with byte fallback), where the word-level one above is refused."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    chars = ["▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(64)] + chars)}
    merges = []
    for c in chars[1:]:
        if len(vocab) >= vocab_size:
            break
        merges.append(("▁", c))
        vocab["▁" + c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return folder
