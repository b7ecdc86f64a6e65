"""The bundled LLM handler with a fault planted in its engine, as a real engine bug would be: a
request with seed :data:`FAULT_SEED` makes the engine raise on it alone. On the OpenVINO engine its
``GenerationConfig`` carries a temperature float32 turns into 0, which OpenVINO GenAI itself refuses
(the fault a tiny temperature caused before requests were checked); on the torch engine its sampler
raises. Every other request is served as by ``LLMHandler``."""
from inference_service.llm.handler import LLMHandler

FAULT_SEED = 4242


class FaultyLLMHandler(LLMHandler):
    def initialize(self, context):
        super().initialize(context)
        if self.engine_name == "openvino":
            from inference_service.llm import openvino_engine

            real_config = openvino_engine.generation_config

            def planted_config(params, generated, eos_ids):
                config = real_config(params, generated, eos_ids)
                if params.seed == FAULT_SEED:
                    config.temperature = 1e-46
                return config

            openvino_engine.generation_config = planted_config
        else:
            from inference_service.llm import runner

            real_penalize = runner.penalize

            def planted_penalize(logits, params, prompt_ids, generated_ids):
                if params.seed == FAULT_SEED:
                    raise RuntimeError("planted sampler fault")
                return real_penalize(logits, params, prompt_ids, generated_ids)

            runner.penalize = planted_penalize
