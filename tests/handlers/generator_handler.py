"""The generator form: each yielded list is one intermediate response per request."""


class WordStreamer:
    def initialize(self, context):
        self.context = context

    def handle(self, data, context):
        words = [bytes(row.get("data") or b"").decode().split() for row in data]
        for i in range(max(len(w) for w in words)):
            yield [w[i] + " " if i < len(w) else None for w in words]
        return ["<done>" for _ in data]
