"""Written for TorchServe 0.12's HTTP API as its users write them: the request ``{"x": [...]}``
is sent as ``application/json``, so TorchServe hands it over decoded, and the handler reads
``data[0]["body"]["x"]``. Answers ``{"y": [2x, ...]}``."""


def handle(data, context):
    if data is None:
        return None
    return [{"y": [2.0 * value for value in row["body"]["x"]]} for row in data]
