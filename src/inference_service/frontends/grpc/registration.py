"""Register servicers with request deserializers that never fail.

gRPC answers a request that does not parse (say, a string field holding
invalid UTF-8) with UNKNOWN. Registering through :func:`add_service` instead
of the generated ``add_*_to_server`` turns such a request into a
:class:`Malformed` value, which the servicer decorators answer with
INVALID_ARGUMENT and a message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError


class Malformed:
    """Stands for a request message that failed to parse.

    Attributes:
        error: the parser's explanation.
    """

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except (DecodeError, ValueError, RuntimeError) as exc:
            return Malformed(str(exc))

    return deserialize


def _passthrough(serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    def serialized(message: Any) -> bytes:  # the servicer may answer already serialized bytes
        return message if isinstance(message, bytes) else serialize(message)

    return serialized


def add_service(server: grpc.aio.Server, service: ServiceDescriptor, servicer: Any,
                send_budget: Any = None) -> None:
    """Register every method of ``service`` on ``server``, served by ``servicer``'s same-named
    methods; ``send_budget`` (a :class:`~.send_budget.SendBudget`) becomes its ``send_budget``."""
    if send_budget is not None:
        servicer.send_budget = send_budget
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(getattr(servicer, method.name),
                                     request_deserializer=_lenient(request_cls.FromString),
                                     response_serializer=_passthrough(response_cls.SerializeToString))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
