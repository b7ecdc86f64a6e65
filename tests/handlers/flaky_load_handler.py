"""Fails to load while the file named by its config (``handler: {fail_while: PATH}``) exists;
once loaded, answers ``loaded``."""
import os


class FlakyLoad:
    def initialize(self, context):
        flag = context.model_yaml_config["handler"]["fail_while"]
        if os.path.exists(flag):
            raise RuntimeError(f"cannot load while {flag} exists")

    def handle(self, data, context):
        return ["loaded"] * len(data)
