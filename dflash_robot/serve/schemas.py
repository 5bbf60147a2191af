"""Request bodies of /v1/chat/completions and /v1/completions (pydantic), with OpenAI's
field names and ranges, and the extensions `top_k` and `block_size`. Unknown fields are
ignored; fields that would change the output in a way this server does not implement
(penalties, logit_bias, logprobs, tools, JSON mode, n > 1, and vLLM's sampling extensions such
as repetition_penalty, min_p or guided decoding) are refused unless set to their "off" value."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

from dflash_robot.serve.errors import ApiError

# field -> values that are accepted (meaning: the feature is off)
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "tools": (None, []), "functions": (None, []),
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    # vLLM / SGLang sampling extensions a client may send in `extra_body`
    "repetition_penalty": (None, 1, 1.0), "min_p": (None, 0, 0.0), "typical_p": (None, 1, 1.0),
    "min_tokens": (None, 0), "ignore_eos": (None, False), "stop_token_ids": (None, []),
    "use_beam_search": (None, False), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)  # extension: 0 = off
    block_size: int | None = Field(None, ge=1)  # extension: tokens verified per step
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int | None = None
    stop: str | list[str] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, off in _UNSUPPORTED.items():
                if name in data and not any(data[name] is o or (type(data[name]) is type(o) and data[name] == o)
                                            for o in off):
                    raise ApiError(400, f"{name} is not supported by this server", param=name)
            fmt = data.get("response_format")
            if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
                raise ApiError(400, "response_format is not supported by this server (only {'type': 'text'})",
                               param="response_format")
        return data

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of at most 16 non-empty strings")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def new_tokens(self, default: int) -> int:
        return self.max_tokens or default

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            kinds = sorted({str(p.get("type")) for p in v if isinstance(p, dict) and p.get("type") != "text"})
            if kinds:
                raise ValueError(f"only text content parts are supported (got {', '.join(kinds)})")
        return v

    def as_dict(self) -> dict[str, str]:
        c = self.content
        text = c if isinstance(c, str) else "".join(p.text for p in c or [])
        return {"role": self.role, "content": text}


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v


def parse(model: type[_Request], data: Any) -> Any:
    """Validate a decoded JSON body; errors become a 400 in OpenAI's shape."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{loc}: {msg}" if loc else msg, param=loc or None) from None
