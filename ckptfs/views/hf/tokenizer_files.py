"""Which files are a tokenizer's, and where a params YAML names one: shared by the tokenizer discovery next to a local
checkpoint (``overlay``) and in a bucket (``s3tokenizer``)."""
from __future__ import annotations

#: the files of a Hugging Face tokenizer (and chat template) served beside a model
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "merges.txt", "vocab.txt",
    "chat_template.jinja", "chat_template.json",
)

#: params YAML keys (at any depth) whose value may be a local tokenizer directory or file
TOKENIZER_PARAM_KEYS = ("tokenizer_path", "tokenizer_file", "tokenizer_dir", "tokenizer", "huggingface_tokenizer",
                        "pretrained_model_name_or_path", "vocab_file", "encoder_file")


def named_in_params(doc, found: list, path: tuple = ()) -> None:
    """(dotted key, value) of every TOKENIZER_PARAM_KEYS string in a params document, in document order."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            if isinstance(v, str) and k in TOKENIZER_PARAM_KEYS:
                found.append((".".join(map(str, path + (k,))), v))
            else:
                named_in_params(v, found, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            named_in_params(v, found, path + (i,))
