"""`SnapshotTokenizer`: a saved tokenizer (tokenizer.json, tokenizer_config.json, the chat
template) read with the `tokenizers` library and `jinja2`, without importing transformers.

Why: the embedded default starts from a converted snapshot of its GGUF (`loading.py`), and
importing transformers took ~2 s of a ~5 s start (`python -X importtime`, 2026-11-30). The
runtime needs five things of a tokenizer: `tok(text)["input_ids"]`, `apply_chat_template`,
`decode`, `eos_token_id` and `chat_template`; this provides exactly those, computed as
transformers' `PreTrainedTokenizerFast` computes them (the same `tokenizers` model and
post-processor; the chat template rendered in a sandboxed jinja2 environment with
`trim_blocks`/`lstrip_blocks` and tokenized without added special tokens).
`tests/test_e2e_smollm2.py` compares it with transformers' tokenizer on the real SmolLM2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


class SnapshotTokenizer:
    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        d = Path(directory)
        self.directory = d
        self._tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg_file = d / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template_file = d / "chat_template.jinja"
        self.chat_template: str | None = template_file.read_text() if template_file.is_file() else \
            cfg.get("chat_template")
        self.special_tokens = {k: _content(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        eos = self.special_tokens["eos_token"]
        self.eos_token_id: int | None = None if eos is None else self._tok.token_to_id(eos)
        self._template: Any = None

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": self._tok.encode(text, add_special_tokens=True).ids}

    def save_pretrained(self, directory: str | Path) -> None:
        """Copy the tokenizer's files (what transformers' `AutoTokenizer` reads back) to `directory`."""
        import shutil

        dest = Path(directory)
        dest.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            if (self.directory / name).is_file():
                shutil.copyfile(self.directory / name, dest / name)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True) -> Any:
        """Rendered text (tokenize=False), else the ids: as {"input_ids": ...} (transformers 5's
        default, return_dict=True) or a plain list."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                from jinja2.exceptions import TemplateError

                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **{k: v for k, v in self.special_tokens.items() if v is not None})
        if not tokenize:
            return text
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids


def _content(token: Any) -> str | None:
    """tokenizer_config.json names a special token as a string or as {"content": ...}."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None
