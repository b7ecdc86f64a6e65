"""Reports serving statistics the way the bundled LLM handler does
(``context.metrics.add_serving_stat``), without a model.

Body ``N``: N intermediate text pieces ``"t0 "``, ``"t1 "``..., then an empty final message.
At load: ``kv_cache_capacity_tokens`` 1000, ``running`` 0. Per request: 1 running while
it streams, ``kv_cache_used_tokens`` 10 x N (kept after it ends), then 0 running, 5 prompt
tokens and N generation tokens.
"""
import json

from ts.handler_utils.utils import send_intermediate_predict_response


def handle(data, context):
    metrics = context.metrics
    if data is None:
        metrics.add_serving_stat("kv_cache_capacity_tokens", 1000)
        metrics.add_serving_stat("running", 0)
        return None
    out = []
    for idx, row in enumerate(data):
        count = int(_text(row.get("data") or row.get("body")))
        metrics.add_serving_stat("running", 1)
        metrics.add_serving_stat("kv_cache_used_tokens", 10 * count)
        for i in range(count):
            message = [None] * len(data)
            message[idx] = f"t{i} "
            send_intermediate_predict_response(message, {idx: context.request_ids[idx]}, "ok", 200, context)
        metrics.add_serving_stat("running", 0)
        metrics.add_serving_stat("prompt_tokens", 5)
        metrics.add_serving_stat("generation_tokens", count)
        out.append("")
    return out


def _text(body):
    """The body as text: TorchServe hands an HTTP body over as str (text/*), decoded (application/json)
    or bytes, a gRPC input as bytes."""
    if isinstance(body, (bytes, bytearray)):
        return bytes(body).decode()
    return body if isinstance(body, str) else json.dumps(body)
