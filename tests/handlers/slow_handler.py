"""A handler whose initialize takes ``load_delay`` seconds (model-config.yaml), to observe loading."""
import time


class SlowLoader:
    def initialize(self, context):
        time.sleep(float(context.model_yaml_config.get("load_delay", 2)))

    def handle(self, data, context):
        return ["loaded" for _ in data]
