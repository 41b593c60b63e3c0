"""OpenAI-compatible request bodies (pydantic) and the OpenAI error shape.

Field names, defaults and ranges follow the OpenAI API (temperature defaults to 1, completions'
max_tokens to 16). Features the engine does not have (logprobs, echo, penalties, tools, ...) are
refused with a clear 400 instead of being silently ignored; unknown fields are ignored.

Extension: a ``draftwise`` object in the body, ``{"method": "ar" | <server method>, "gamma": int}``
(the official client sends it with ``extra_body={"draftwise": {...}}``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..sampling import SEED_MAX, SEED_MIN


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class DraftwiseOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: str | None = None
    gamma: int | None = Field(default=None, ge=0)


def _bad_text(value: Any, path: str) -> str | None:
    """The path of the first string in a JSON value that is not valid Unicode text (a lone surrogate
    such as "\\ud800", which JSON can carry and UTF-8 cannot), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(value, dict):
        for k, v in value.items():
            if (bad := _bad_text(v, f"{path}.{k}" if path else str(k))) is not None:
                return bad
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if (bad := _bad_text(v, f"{path}[{i}]")) is not None:
                return bad
    return None


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)  # the OpenAI API's range
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)  # extension (as in vLLM); 0 = off
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)  # int64 or uint64; used modulo 2**64
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False  # extension (as in vLLM)
    draftwise: DraftwiseOptions | None = None
    # refused unless left at their defaults
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data):
        bad = _bad_text(data, "")
        if bad is not None:
            raise PydanticCustomError("invalid_text", "{param}: the text is not valid Unicode (lone surrogate)",
                                      {"param": bad})
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def unsupported(self) -> list[tuple[str, str]]:
        """(param, message) for every feature asked for that this server does not have."""
        out = []
        if self.logprobs not in (None, False, 0):
            out.append(("logprobs", "logprobs are not supported"))
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                out.append((name, f"{name} is not supported (only 0)"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported"))
        return out


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.echo:
            out.append(("echo", "echo is not supported"))
        if self.suffix:
            out.append(("suffix", "suffix is not supported"))
        if self.best_of not in (None, 1, self.n):
            out.append(("best_of", "best_of is not supported"))
        return out

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict:
        if isinstance(self.content, list):
            if any(p.type != "text" for p in self.content):
                raise ValueError("only text content parts are supported")
            text = "".join(p.text or "" for p in self.content)
        else:
            text = self.content or ""
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    top_logprobs: int | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.tools or self.functions:
            out.append(("tools", "tools / function calling are not supported"))
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            out.append(("response_format", "only response_format type 'text' is supported"))
        if self.top_logprobs:
            out.append(("top_logprobs", "logprobs are not supported"))
        return out
