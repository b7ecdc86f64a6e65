"""A handler file that is only a module-level ``handle(data, context)`` (no class at all)."""

STATE = {"loads": 0}


def handle(data, context):
    if data is None:
        STATE["loads"] += 1
        return None
    return [f"only:{STATE['loads']}:{bytes(row.get('data') or row.get('body')).decode()}" for row in data]
