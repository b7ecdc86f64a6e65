"""Causal language models served by streaming handlers.

- :mod:`inference_service.llm.requests`: request parsing and validation.
- :mod:`inference_service.llm.params`: the options of one generation and its result.
- :mod:`inference_service.llm.sampling`: greedy and temperature / top-p sampling.
- :mod:`inference_service.llm.text`: incremental decoding and stop strings.
- :mod:`inference_service.llm.request_state`: one request's state in the engine.
- :mod:`inference_service.llm.kv_cache`: helpers on the engine's batched KV cache.
- :mod:`inference_service.llm.engine`: the batched, continuous-batching
  generation engine.
- :mod:`inference_service.llm.generation`: prompt building and the one-request
  generation helpers (:func:`~inference_service.llm.generation.generate_pieces`).
- :mod:`inference_service.llm.model`: locating the default SmolLM2 GGUF,
  converting a GGUF once into a cached safetensors model directory, loading.
- :mod:`inference_service.llm.handler`: ``LLMHandler``, streaming through
  ``send_intermediate_predict_response``.
- :mod:`inference_service.llm.generator_handler`: ``LLMGeneratorHandler``,
  the same in generator form.

Importing this package imports neither torch nor transformers; the
submodules import them where needed.
"""
