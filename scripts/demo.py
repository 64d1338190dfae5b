"""The README demo: mount the bundled tiny Cerebras checkpoint, list it, load it with transformers through the
mount, run a forward pass, print the top tokens, unmount. Nothing is converted up front."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CKPT = REPO / "examples" / "tiny-llama" / "checkpoint_0.mdl"
ORIGINAL_HF = REPO / "tests" / "fixtures" / "llama" / "hf"


def ckptfs(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "ckptfs", *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"ckptfs {' '.join(args)} failed:\n{out.stderr.strip()}")
    return out.stdout


def main() -> int:
    print(ckptfs("info", str(CKPT)))
    with tempfile.TemporaryDirectory(prefix="ckptfs-demo-") as mnt:
        print(f"$ ckptfs mount {CKPT.relative_to(REPO)} {mnt}")
        print(ckptfs("mount", str(CKPT), mnt).strip())
        try:
            print(f"$ ls -l {mnt}")
            print(subprocess.run(["ls", "-l", mnt], capture_output=True, text=True).stdout)
            import torch
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(mnt).eval()
            ids = torch.tensor([[1, 5, 17, 42, 99, 3]])
            with torch.no_grad():
                logits = model(ids).logits
            top = torch.topk(logits[0, -1], 5)
            print(f"loaded {type(model).__name__} from the mount; input ids {ids[0].tolist()}")
            print("top-5 next tokens:", ", ".join(f"{i}({v:.3f})" for i, v in zip(top.indices.tolist(), top.values.tolist())))
            if ORIGINAL_HF.is_dir():
                ref = AutoModelForCausalLM.from_pretrained(ORIGINAL_HF).eval()
                with torch.no_grad():
                    same = torch.equal(ref(ids).logits, logits)
                print(f"logits identical to the original Hugging Face model: {same}")
                if not same:
                    return 1
            del model
        finally:
            print(f"$ ckptfs umount {mnt}")
            ckptfs("umount", mnt)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
