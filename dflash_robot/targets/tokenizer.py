"""`SnapshotTokenizer`: a saved tokenizer (tokenizer.json, tokenizer_config.json, the chat
template) read with the `tokenizers` library and `jinja2`, without importing transformers.

Why: the embedded default starts from a converted snapshot of its GGUF (`snapshot.py`), and
importing transformers took ~2 s of a ~5 s start (`python -X importtime`, 2026-11-30). The
runtime needs five things of a tokenizer: `tok(text)["input_ids"]`, `apply_chat_template`
(role/content messages, a generation prompt), `decode`, `eos_token_id` and `chat_template`. They
are computed as transformers' tokenizer computes them: the same `tokenizers` model and
post-processor, the chat template rendered in a sandboxed jinja2 environment set up as
transformers sets it up (`trim_blocks`, `lstrip_blocks`, `loopcontrols`, its `tojson`,
`raise_exception` and `strftime_now`, `tools` and `documents` None) and tokenized without added
special tokens.

"As transformers computes them" is checked, not assumed: `verify_against` compares both
tokenizers on probe texts and conversations when a snapshot is written or first read through
transformers, and records the result in the snapshot (`MARKER`); only a verified snapshot is
started without transformers (`snapshot.open_snapshot`). A tokenizer class that rewrites the saved
normalizer (transformers 5 does for some), or a template this renderer does not render alike, so
keeps the transformers path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
MARKER = "dflash-robot-tokenizer.json"  # {"version": ..., "verified": bool}
MARKER_VERSION = 1
PROBE_TEXTS = ("Write a Python function that returns the sum of a list.", "", "  two  spaces\n\n\ttab",
               "héllo wörld 👋 naïve café", "cafe\u0301 \u212b \uff21\uff22", "<|im_start|>literal tags<|im_end|>",
               "1234567 + 89 = ?", "日本語のテキスト")


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

    def __call__(self, text: str, add_special_tokens: bool = True, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": self._tok.encode(text, add_special_tokens=add_special_tokens).ids}

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

            def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                       sort_keys: bool = False) -> str:
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            def strftime_now(fmt: str) -> str:
                from datetime import datetime

                return datetime.now().strftime(fmt)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = strftime_now
            self._template = env.from_string(self.chat_template)
        text = self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
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


def _ids(x: Any) -> list[int]:
    return list(x["input_ids"] if isinstance(x, dict) or hasattr(x, "keys") else x)


def verify_against(reference: Any, directory: str | Path) -> bool:
    """Does `SnapshotTokenizer(directory)` give what `reference` (a transformers tokenizer) gives,
    on the probe texts, as plain text and as chat conversations (user; system + user + assistant +
    user), and the same eos id? Writes the answer into `directory/MARKER`; any failure is False."""
    d = Path(directory)
    try:
        ours = SnapshotTokenizer(d)
        ok = ours.eos_token_id == getattr(reference, "eos_token_id", None)
        has_template = bool(getattr(reference, "chat_template", None))
        ok = ok and has_template == bool(ours.chat_template)
        for text in PROBE_TEXTS:
            if not ok:
                break
            ids = reference(text)["input_ids"]
            ok = list(ids) == ours(text)["input_ids"] and reference.decode(ids, skip_special_tokens=True) == \
                ours.decode(ids, skip_special_tokens=True)
            if ok and has_template:
                for chat in ([{"role": "user", "content": text}],
                             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text},
                              {"role": "assistant", "content": text[::-1]}, {"role": "user", "content": "And?"}]):
                    want = _ids(reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=True))
                    ok = ok and want == _ids(ours.apply_chat_template(chat, add_generation_prompt=True))
    except Exception:  # noqa: BLE001 - anything this renderer cannot do means "not verified"
        ok = False
    try:
        (d / MARKER).write_text(json.dumps({"version": MARKER_VERSION, "verified": bool(ok)}) + "\n")
    except OSError:
        return False
    return bool(ok)


def verified(directory: str | Path) -> bool:
    try:
        m = json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and m.get("version") == MARKER_VERSION and m.get("verified") is True
