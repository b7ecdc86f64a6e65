"""The request header that asks a handler for an explanation instead of a prediction.

TorchServe 0.12's ``InferenceRequestHandler`` sets ``explain: True`` on ``/explanations``,
KServe v1 ``:explain`` and v2 ``/explain``, and ``explain: False`` on their prediction routes;
``BaseHandler`` then calls ``explain_handle``. Only those routes set it: a client's own
``explain`` header (any case) never reaches the handler.
"""

from __future__ import annotations

from collections.abc import Mapping

EXPLAIN_HEADER = "explain"


def set_explain(headers: dict[str, str], explain: bool) -> dict[str, str]:
    """``headers`` (changed in place and returned) without any client ``explain`` header, with TorchServe's."""
    for key in [k for k in headers if k.lower() == EXPLAIN_HEADER]:
        del headers[key]
    headers[EXPLAIN_HEADER] = "True" if explain else "False"
    return headers


def is_explanation(headers: Mapping[str, str]) -> bool:
    """Whether a request's headers ask for an explanation (TorchServe's test: the value ``True``)."""
    return headers.get(EXPLAIN_HEADER) == "True"
