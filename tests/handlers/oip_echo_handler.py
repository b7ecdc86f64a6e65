"""Open Inference Protocol test handler: a module-level ``handle`` that reads the v2 JSON body
TorchServe hands a handler for ``ModelInfer`` and answers a v2 response.

Each input comes back as an output: a BYTES input as ``<name>_upper`` (its base64 elements
decoded, upper-cased), any other as ``<name>_echo`` (same datatype, shape and data). Request
parameters: ``show_request`` adds a BYTES output ``request`` holding the JSON body the handler
got; ``answer`` = ``not_v2`` answers plain text, ``bad_shape`` an output whose data do not fill
its shape, ``fp16`` an FP16 output ``half`` = [0.5, 1.5]; ``fail`` raises.
"""
import base64
import json


def _answer(request):
    params = request.get("parameters") or {}
    if params.get("fail"):
        raise ValueError("the handler failed on purpose")
    if params.get("answer") == "not_v2":
        return "plain text"
    outputs = []
    for tensor in request["inputs"]:
        if tensor["datatype"] == "BYTES":
            texts = [base64.b64decode(v).decode("utf-8").upper() for v in tensor["data"]]
            outputs.append({"name": tensor["name"] + "_upper", "datatype": "BYTES", "shape": tensor["shape"],
                            "data": texts})
        else:
            outputs.append({"name": tensor["name"] + "_echo", "datatype": tensor["datatype"],
                            "shape": tensor["shape"], "data": tensor["data"]})
    if params.get("show_request"):
        outputs.append({"name": "request", "datatype": "BYTES", "shape": [1], "data": [json.dumps(request)]})
    if params.get("answer") == "bad_shape":
        outputs.append({"name": "bad", "datatype": "INT64", "shape": [3], "data": [1, 2]})
    if params.get("answer") == "fp16":
        outputs.append({"name": "half", "datatype": "FP16", "shape": [2], "data": [0.5, 1.5]})
    return {"id": request.get("id"), "model_name": request["model_name"], "outputs": outputs}


def handle(data, context):
    if data is None:  # the load-time call
        return None
    return [_answer(json.loads(bytes(row.get("body") or row.get("data")))) for row in data]
