"""Causal language models served by streaming handlers.

- :mod:`inference_service.llm.generation`: request parsing and validation,
  sampling, incremental decoding, stop strings and the token-by-token
  generation loop (:func:`~inference_service.llm.generation.generate_pieces`).
- :mod:`inference_service.llm.model`: locating the default SmolLM2 GGUF,
  converting a GGUF once into a cached safetensors model directory, loading.
- :mod:`inference_service.llm.handler`: ``LLMHandler``, streaming through
  ``send_intermediate_predict_response``.
- :mod:`inference_service.llm.generator_handler`: ``LLMGeneratorHandler``,
  the same in generator form.

Importing this package imports neither torch nor transformers; the
submodules import them where needed.
"""
