"""An LLM over the Open Inference Protocol (KServe v2): an inference request whose one BYTES input
holds a prompt (or an LLM request as JSON) generates its answer as one BYTES output, and Triton's
generate extension (``/v2/models/<m>/generate`` and ``/generate_stream``, ``text_input`` /
``text_output``, sampling in ``parameters``), which KServe's and Triton's LLM clients send.

Both become the LLM handler's typed request (contracts/sampling.py), as the OpenAI door's do, run
as one stream on the core; the handler and its envelope-free worker never see a v2 body. See
docs/open-inference-protocol.md, "An LLM".
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from inference_service.contracts.outputs import FinalMessage
from inference_service.contracts.sampling import REQUEST_FIELDS
from inference_service.errors import InvalidArgument
from inference_service.frontends.oip.protocol import InferRequest, InferResponse, Tensor, infer, model_parameters
from inference_service.serving.core import InferenceCore

#: The output an LLM's answer is written to (Triton's vLLM backend's name).
TEXT_OUTPUT = "text_output"
#: Triton's and vLLM's parameter names read as this server's (the others pass as they are).
_ALIASES = {"max_tokens": "max_new_tokens"}
#: Parameters of Triton's generate extension that are not the model's.
_TRANSPORT = frozenset({"stream"})


def llm_body(text: str, parameters: Mapping[str, Any], where: str, chat: bool = False) -> bytes:
    """The LLM handler's JSON body of ``text`` (a prompt, a user's message when ``chat``, or an LLM
    request as a JSON object) with the request's ``parameters`` over it (``max_tokens`` read as
    ``max_new_tokens``).

    Raises:
        InvalidArgument: a parameter the LLM does not take (the message names it and ``where``).
    """
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            decoded = json.loads(text)
        except ValueError:
            decoded = None
        if isinstance(decoded, dict) and {"prompt", "messages"} & set(decoded):
            body = decoded
    for key, value in parameters.items():
        name = _ALIASES.get(key, key)
        if key in _TRANSPORT:
            continue
        if name not in REQUEST_FIELDS:
            raise InvalidArgument(f"{where}: parameter {key!r} is not one this LLM takes; it takes "
                                  f"{', '.join(sorted(set(REQUEST_FIELDS) - {'prompt', 'messages'}))} and max_tokens")
        body[name] = value
    return json.dumps(body).encode()


def prompt_of(request: InferRequest) -> str:
    """The text of the request's one BYTES input of one element (a JSON string as it is, bytes as UTF-8).

    Raises:
        InvalidArgument: (400) not exactly one input, not BYTES, not one element, or not UTF-8;
            the message names the input.
    """
    if len(request.inputs) != 1:
        raise InvalidArgument(f"this model is an LLM: send one BYTES input holding the prompt (or an LLM request "
                              f"as JSON), got {len(request.inputs)} inputs")
    tensor: Tensor = request.inputs[0]
    if tensor.datatype != "BYTES" or len(tensor.data) != 1:
        raise InvalidArgument(f"inputs[0] ({tensor.name!r}): this model is an LLM: send one BYTES element holding "
                              f"the prompt, got {tensor.datatype} with {len(tensor.data)} elements")
    data = list(tensor.data[:1]) if not isinstance(tensor.data, list) else tensor.data
    value = data[0]
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument(f"inputs[0] ({tensor.name!r}): the prompt is not UTF-8") from None
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"inputs[0] ({tensor.name!r}): the prompt must be a non-empty string")
    return value


async def generate(core: InferenceCore, name: str, version: str, body: bytes, headers: dict[str, str],
                   time_remaining: float | None = None) -> AsyncGenerator[tuple[str, bool], None]:
    """``(text piece, final)`` of the LLM's answer to ``body``, as the handler streams it; the final
    item holds the text not sent before. Raises as :meth:`InferenceCore.stream`."""
    stream = core.stream(name, version, {"body": body}, headers, time_remaining)
    async for payload, final in stream:
        message = FinalMessage.parse(payload) if final else None  # the LLM's last message: its usage and the rest
        yield message.text if message is not None else payload.decode("utf-8", "replace"), final


async def infer_llm(core: InferenceCore, request: InferRequest, headers: dict[str, str],
                    time_remaining: float | None = None) -> InferResponse:
    """An inference request to an LLM: its answer as the BYTES output :data:`TEXT_OUTPUT`, shape [1].
    A plain text is the user's message when the model has a chat template (an instruct model's
    answer), else the prompt."""
    model = core.get(request.model_name, request.model_version)
    template = model.chat_template or ""
    body = llm_body(prompt_of(request), model_parameters(request.parameters), "parameters",
                    chat=bool(template) and not template.startswith("none"))
    pieces = [piece async for piece, _ in generate(core, request.model_name, model.version, body, headers,
                                                     time_remaining)]
    return InferResponse(request.model_name, model.version, request.id,
                         [Tensor(TEXT_OUTPUT, "BYTES", [1], ["".join(pieces)])])


async def infer_any(core: InferenceCore, request: InferRequest, headers: dict[str, str],
                    time_remaining: float | None = None) -> InferResponse:
    """An inference request as its model takes it: an LLM's through :func:`infer_llm`, any other
    model's through :func:`~inference_service.frontends.oip.protocol.infer`."""
    if core.get(request.model_name, request.model_version).accepts_generation:
        return await infer_llm(core, request, headers, time_remaining)
    return await infer(core, request, headers, time_remaining)
