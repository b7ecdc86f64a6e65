"""A handler whose initialize raises: registration must fail with this message."""


class Broken:
    def initialize(self, context):
        raise RuntimeError("weights are corrupt (test)")

    def handle(self, data, context):
        return data
