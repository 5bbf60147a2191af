"""Export to edge runtimes: ExecuTorch (`executorch.py`, `runtime.py`); GGUF drafts are in drafts/gguf.py."""
