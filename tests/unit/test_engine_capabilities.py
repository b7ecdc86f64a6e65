"""The engines' declared capabilities: the refusals and docs/llm.md's field table come from them."""

from __future__ import annotations

from pathlib import Path

from inference_service.contracts.sampling import PARAM_FIELDS, GenerationParams
from inference_service.llm.engine import GenerationEngine
from inference_service.llm.engine_protocol import capability_table, refusal
from inference_service.llm.engines import CAPABILITIES
from inference_service.llm.llamacpp_engine import LlamaCppEngine
from inference_service.llm.openvino_engine import OpenVINOEngine
from inference_service.llm.vllm_engine import VLLMEngine

DOCS = Path(__file__).resolve().parents[2] / "docs" / "llm.md"


def test_the_docs_table_is_the_declared_capabilities():
    assert capability_table(list(CAPABILITIES.values())) in DOCS.read_text(encoding="utf-8")


def test_every_engine_is_declared_once():
    assert CAPABILITIES == {"openvino": OpenVINOEngine.capabilities, "torch": GenerationEngine.capabilities,
                            "vllm": VLLMEngine.capabilities, "llamacpp": LlamaCppEngine.capabilities}
    for capabilities in CAPABILITIES.values():
        assert set(capabilities.unsupported) <= set(PARAM_FIELDS)


def test_a_refusal_names_the_field_and_the_engine_that_has_it():
    every = tuple(CAPABILITIES.values())
    params = GenerationParams(presence_penalty=0.5)
    assert refusal(CAPABILITIES["torch"], params, every) is None
    message = refusal(CAPABILITIES["openvino"], params, every)
    assert message == ("'presence_penalty' is not supported by the openvino engine (its rule differs from "
                       "OpenAI's); serve the model with 'engine: torch' or 'engine: vllm' or "
                       "'engine: llamacpp' to use it")
    assert refusal(CAPABILITIES["openvino"], GenerationParams(presence_penalty=0.0), every) is None
