"""The LLM handler's answers to tokenizer requests (:mod:`inference_service.contracts.tokenizer`),
with the model's own tokenizer and chat template, in vLLM's shapes."""

from __future__ import annotations

from typing import Any

from inference_service.contracts.sampling import InvalidRequest
from inference_service.contracts.tokenizer import NO_CHAT_TEMPLATE, DetokenizeRequest, TokenizeRequest
from inference_service.llm.generation import template_messages


def answer(tokenizer: Any, request: TokenizeRequest | DetokenizeRequest, context_length: int | None) -> dict[str, Any]:
    """``{"count", "max_model_len", "tokens", "token_strs"}`` or ``{"prompt"}``.

    Raises:
        InvalidRequest: no chat template for ``messages``, the template refuses them, or a token id
            outside the vocabulary.
    """
    if isinstance(request, DetokenizeRequest):
        size = len(tokenizer)
        outside = next((t for t in request.tokens if t >= size), None)
        if outside is not None:
            raise InvalidRequest(f"'tokens' holds {outside}, outside the vocabulary (0..{size - 1})", "tokens")
        return {"prompt": tokenizer.decode(list(request.tokens))}
    if request.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest(NO_CHAT_TEMPLATE)
        from jinja2 import TemplateError

        try:  # rendered as a generation's prompt is (llm/generation.py)
            text = tokenizer.apply_chat_template(template_messages(request.messages), tokenize=False,
                                                 add_generation_prompt=request.add_generation_prompt,
                                                 continue_final_message=request.continue_final_message,
                                                 tools=list(request.tools) or None)
        except (TemplateError, ValueError) as exc:
            raise InvalidRequest(f"cannot apply the chat template to 'messages': {exc}", "messages") from None
    else:
        text = request.prompt or ""
    ids = [int(i) for i in tokenizer(text, add_special_tokens=request.add_special_tokens)["input_ids"]]
    return {"count": len(ids), "max_model_len": context_length or 0, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None}
