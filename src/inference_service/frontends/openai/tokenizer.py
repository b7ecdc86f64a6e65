"""vLLM's ``/tokenize`` and ``/detokenize`` bodies (one model for both of vLLM's tokenize forms:
``prompt`` or ``messages``), checked as the other OpenAI requests and turned into the typed
tokenizer requests of :mod:`inference_service.contracts.tokenizer`, which the model's worker answers."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from inference_service.contracts.tokenizer import DetokenizeRequest, TokenizeRequest
from inference_service.frontends.openai.schemas import ChatMessage, OpenAIRequest


class TokenizeBody(OpenAIRequest):
    """``POST /tokenize``: ``prompt`` or ``messages``, vLLM's flags (``None``: vLLM's default)."""

    model: str = Field(min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    return_token_strs: bool | None = None

    def to_request(self) -> TokenizeRequest:
        """Raises InvalidRequest: both or neither of ``prompt``/``messages``."""
        values: dict[str, Any] = {
            "prompt": self.prompt, "add_special_tokens": self.add_special_tokens,
            "add_generation_prompt": self.add_generation_prompt, "continue_final_message": self.continue_final_message,
            "return_token_strs": self.return_token_strs,
            "messages": None if self.messages is None else [{"role": m.role, "content": m.content or ""}
                                                            for m in self.messages]}
        return TokenizeRequest.build({key: value for key, value in values.items() if value is not None})


class DetokenizeBody(OpenAIRequest):
    """``POST /detokenize``: the token ids to turn into text."""

    model: str = Field(min_length=1)
    tokens: list[int]

    def to_request(self) -> DetokenizeRequest:
        """Raises InvalidRequest: too many ids, or a negative one."""
        return DetokenizeRequest.build({"tokens": self.tokens})


def build_shapes() -> None:
    """Build the validators ``defer_build`` put off (the server does it before it serves)."""
    for shape in (TokenizeBody, DetokenizeBody):
        shape.model_rebuild()
