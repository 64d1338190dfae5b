"""Runs llama.cpp's HF -> GGUF converter (``convert_hf_to_gguf.py``, which scripts/setup.sh takes from the
llama-cpp-python source package into ``<venv>/share/llama.cpp``) on several folders in one process, as its own
command line would, since its imports (torch, transformers) cost seconds each time.

    python ggufhelp.py CONVERTER JOBS_JSON   # JOBS_JSON: [[folder, outfile, pre_tokenizer or null], ...]

prints one JSON line: [null (converted) or "ExceptionType: message", ...] per job. ``pre_tokenizer`` set makes the
converter's BPE pre-tokenizer recognition (``TextModel.get_vocab_base_pre``, which knows tokenizers only by the ids
they give for a fixed text) answer that name: the only step of the converter a test may replace, and says why.
"""
from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

#: the converter's location in the virtual environment scripts/setup.sh makes
CONVERTER = Path(sys.prefix) / "share" / "llama.cpp" / "convert_hf_to_gguf.py"


def main() -> None:
    converter, jobs = Path(sys.argv[1]), json.loads(sys.argv[2])
    sys.path.insert(0, str(converter.parent))  # its conversion/ package, as when run as a script
    import conversion.base as base

    recognise = base.TextModel.get_vocab_base_pre
    results = []
    for folder, outfile, pre in jobs:
        base.TextModel.get_vocab_base_pre = (lambda self, tokenizer, pre=pre: pre) if pre else recognise
        sys.argv = [str(converter), folder, "--outfile", outfile, "--outtype", "f16"]
        try:
            runpy.run_path(str(converter), run_name="__main__")
            results.append(None)
        except SystemExit as e:
            results.append(None if not e.code else f"SystemExit: {e.code}")
        except Exception as e:  # reported per job: the test says which folders may fail and why
            results.append(f"{type(e).__name__}: {e}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
