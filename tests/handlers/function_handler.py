"""A ``module:function`` entry point: called once with data=None at load, then per batch."""
STATE = {"initialized": False}


def handle(data, context):
    if data is None:
        STATE["initialized"] = True
        return None
    return [f"fn:{STATE['initialized']}:{bytes(row.get('data') or row.get('body')).decode()}" for row in data]
