"""OpenAI response bodies and server-sent-event chunks, for chat and text completions.

Every answer carries the request's speculative statistics in the extension object
`dflash` (`SpecStats.dflash`): in the body, or in the final chunks of a stream (the one
with `finish_reason`, and the usage chunk when `stream_options.include_usage`)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from dflash_robot.serve.engine import SpecStats


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


class Format:
    """The shapes of one answer; `chat` picks chat.completion(.chunk) over text_completion."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self, text: str, reason: str, stats: SpecStats) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": stats.usage(), "dflash": stats.dflash()}

    def _chunk(self, piece: dict[str, Any] | str | None, reason: str | None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": piece if isinstance(piece, dict) else
                      ({"content": piece} if piece else {}), "logprobs": None, "finish_reason": reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def start(self) -> str | None:
        """The opening chunk (chat: the assistant role), or None."""
        return sse(self._chunk({"role": "assistant", "content": ""}, None)) if self.chat else None

    def delta(self, text: str) -> str:
        return sse(self._chunk(text, None))

    def end(self, reason: str, stats: SpecStats, include_usage: bool) -> str:
        """The chunk with `finish_reason`, the usage chunk if asked for, then [DONE]."""
        last = {**self._chunk(None, reason), "dflash": stats.dflash()}
        out = sse(last)
        if include_usage:
            usage = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                     "usage": stats.usage(), "dflash": stats.dflash()}
            out += sse(usage)
        return out + DONE
