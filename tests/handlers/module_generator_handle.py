"""This project's generator form as a module-level ``handle``: each ``yield`` is one intermediate
response per request, the ``return`` value the final one. At load it is called with
``data=None`` and run to its end."""

STATE = {"loaded": False}


def handle(data, context):
    if data is None:
        STATE["loaded"] = True
        return
    words = [bytes(row.get("data") or row.get("body")).decode().split() for row in data]
    for i in range(max(len(w) for w in words)):
        yield [w[i] + " " if i < len(w) else None for w in words]
    return [f"<loaded={STATE['loaded']}>" for _ in data]
