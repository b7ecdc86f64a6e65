"""OpenAI's shapes of log probabilities in answers: a chat choice's ``{"content": [...]}`` and a
completion choice's legacy ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, made
from the LLM handler's entries (:class:`~inference_service.contracts.outputs.TokenLogprob`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from inference_service.contracts.outputs import TokenLogprob


class _Shape(BaseModel):
    model_config = ConfigDict(defer_build=True)


class TopLogprob(_Shape):
    """One likely token at a position (OpenAI's ``top_logprobs`` entry)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """A sampled token of a chat answer and the most likely tokens at its position."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Shape):
    """A chat choice's ``logprobs``: one entry per sampled token of its content."""

    content: list[ChatTokenLogprob]

    @classmethod
    def of(cls, entries: tuple[TokenLogprob, ...]) -> ChatLogprobs:
        return cls(content=[ChatTokenLogprob(token=e.token, logprob=e.logprob, bytes=list(e.bytes), top_logprobs=[
            TopLogprob(token=t.token, logprob=t.logprob, bytes=list(t.bytes)) for t in e.top_logprobs])
            for e in entries])


class CompletionLogprobs(_Shape):
    """A completion choice's ``logprobs`` (OpenAI's legacy shape): per sampled token its text, log
    probability, the most likely tokens with the sampled one (``{token: logprob}``) and the offset
    of its first character in the choice's ``text``."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]

    @classmethod
    def of(cls, entries: tuple[TokenLogprob, ...], offset: int) -> CompletionLogprobs:
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry.token)
        tops = [{**{t.token: t.logprob for t in e.top_logprobs}, e.token: e.logprob} for e in entries]
        return cls(tokens=[e.token for e in entries], token_logprobs=[e.logprob for e in entries],
                   top_logprobs=tops, text_offset=offsets)


def build_shapes() -> None:
    """Build the validators ``defer_build`` put off (the server does it before it serves)."""
    for shape in (TopLogprob, ChatTokenLogprob, ChatLogprobs, CompletionLogprobs):
        shape.model_rebuild()
