#!/usr/bin/env python3
"""Command-line gRPC client for inference-service (and TorchServe).

Takes the same command line as TorchServe's ``ts_scripts/torchserve_grpc_client.py``
and talks to the same wire API (TorchServe 0.12's ``inference.proto`` and
``management.proto``), so it works against inference-service and TorchServe alike.

Subcommands::

    register      <model_name> [mar_set]                 RegisterModel (synchronous, 1 worker)
    infer         <model_name> <input_file>              Predictions
    infer_stream  <model_name> <input_file>              StreamPredictions, printed as it arrives
    infer_stream2 <model_name> <sequence_id> <files>     StreamPredictions2, one request per file
    unregister    <model_name>                           UnregisterModel

Examples (from the repository root)::

    python clients/torchserve_grpc_client.py register smollm2
    python clients/torchserve_grpc_client.py register smollm2 smollm2-v2.mar
    python clients/torchserve_grpc_client.py infer resnet-18 kitten.jpg
    python clients/torchserve_grpc_client.py infer_stream smollm2 prompt.txt
    python clients/torchserve_grpc_client.py infer_stream2 stateful seq_0 in1.txt,in2.txt
    python clients/torchserve_grpc_client.py unregister smollm2
    python clients/torchserve_grpc_client.py --key-file key_file.json infer mnist 0.png
    python clients/torchserve_grpc_client.py infer mnist 0.png --auth-token XYZ

Options may be given before or after the subcommand (TorchServe's client takes
``--auth-token`` after it).  ``--auth-token`` (or the matching key of
``--key-file``) is sent as ``authorization: Bearer <token>`` metadata; ``--tls-ca``
(and ``--tls-cert`` / ``--tls-key`` for mutual TLS) connect over TLS.  Every call
also carries TorchServe's client metadata ``protocol: gRPC`` and ``session_id``.

Finding the server: without ``--inference-port`` / ``--management-port`` / ``--key-file``
(and ``--auth-token``), the client reads them from the status file of a server started in
the current directory, ``.inference_service/status.json`` (``--run-dir DIR`` reads
``DIR/status.json``, the server's ``--run-dir``); with no status file there it uses
TorchServe's defaults, 7070 / 7071 and no key.  A flag always wins over the status file.

``--timeout`` is a deadline per RPC in seconds; for the streaming subcommands it
bounds the whole stream.  Default: no deadline (registration can load a large
model, and a streamed LLM answer can take minutes).

Exit status: 0 on success; 1 when an RPC fails (``error: <CODE>: <details>`` on
stderr), an input or key file cannot be read, or a StreamPredictions2 response
carries an error status; 2 on a usage error; 130 when interrupted by Ctrl-C (the
call in flight is cancelled first).
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import json
import re
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import grpc

try:
    import inference_service  # noqa: F401  (installed, e.g. editable)
except ImportError:  # running from a checkout: use <repo>/src
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from inference_service._proto import (
    inference_pb2,
    inference_pb2_grpc,
    management_pb2,
    management_pb2_grpc,
)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_INTERRUPTED = 130

# Metadata TorchServe's reference client sends on every call.
BASE_METADATA: tuple[tuple[str, str], ...] = (("protocol", "gRPC"), ("session_id", "12345"))

# Clients should not impose gRPC's default 4 MiB receive limit on predictions;
# the server enforces its own limits.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
]

# "name=location" entry of a register mar_set (a URL with "=" in its query
# string does not match: its part before "=" holds ":" , "/" or "?").
_NAMED_ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.\-]*)=(.+)$")


class ClientError(Exception):
    """A local failure (unreadable input or key file) reported as ``error: ...``."""


def _add_common_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """Add the connection/auth options to ``parser``.

    The top-level parser gets real defaults; each subcommand parser gets the same
    options with suppressed defaults, so an option given after the subcommand
    overrides one given before it and an absent one leaves it untouched.
    """

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    group = parser.add_argument_group("connection options")
    group.add_argument("--host", default=default("127.0.0.1"), help="server host (default: 127.0.0.1)")
    group.add_argument(
        "--inference-port",
        type=int,
        default=default(None),
        metavar="PORT",
        help="gRPC inference API port (default: the run directory's status.json, else 7070)",
    )
    group.add_argument(
        "--management-port",
        type=int,
        default=default(None),
        metavar="PORT",
        help="gRPC management API port (default: the run directory's status.json, else 7071)",
    )
    group.add_argument(
        "--run-dir",
        default=default(None),
        metavar="DIR",
        help="the server's run directory, whose status.json gives the ports and key file "
        "(default: .inference_service)",
    )
    group.add_argument(
        "--model-version",
        default=default(None),
        metavar="VERSION",
        help="model version for infer*/unregister (default: the default version; "
        "register takes the version from the archive)",
    )
    group.add_argument(
        "--timeout",
        type=float,
        default=default(None),
        metavar="SECONDS",
        help="deadline of each RPC in seconds; for streams it bounds the whole stream (default: none)",
    )
    group.add_argument(
        "--auth-token",
        dest="auth_token",
        default=default(None),
        metavar="TOKEN",
        help="authorization token, sent as 'authorization: Bearer TOKEN' (wins over --key-file)",
    )
    group.add_argument(
        "--key-file",
        default=default(None),
        metavar="PATH",
        help="TorchServe key_file.json: its inference key is used for inference "
        "calls, its management key for management calls (default: the one the run "
        "directory's status.json names)",
    )
    group.add_argument(
        "--tls-ca",
        default=default(None),
        metavar="PEM",
        help="connect over TLS, trusting the CA certificates of this PEM file",
    )
    group.add_argument(
        "--tls-cert",
        default=default(None),
        metavar="PEM",
        help="client certificate chain for mutual TLS (with --tls-key; implies TLS)",
    )
    group.add_argument(
        "--tls-key",
        default=default(None),
        metavar="PEM",
        help="private key of --tls-cert",
    )


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser (TorchServe's subcommands plus our options)."""
    parser = argparse.ArgumentParser(
        prog="torchserve_grpc_client.py",
        description="TorchServe-compatible gRPC client for inference-service.",
        epilog="Options may also be given after the subcommand. Exit status: 0 ok, "
        "1 error, 2 usage error, 130 interrupted.",
    )
    _add_common_options(parser, suppress=False)
    subparsers = parser.add_subparsers(dest="action", metavar="ACTION", help="Action")
    subparsers.required = True

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("model_name", help="Name of the model used.")
        _add_common_options(sub, suppress=True)
        return sub

    register = add("register", "Register a model archive (synchronously, 1 worker).")
    register.add_argument(
        "mar_set",
        nargs="?",
        default=None,
        help="Model archive in the server's model store, or URL (default: "
        "<model_name>.mar). A comma separated list in [model_name=]model_location "
        "format is accepted too: the entry for <model_name> is used.",
    )
    infer = add("infer", "Run one inference (Predictions) and print the prediction.")
    infer.add_argument("model_input", help="Input for model for inference.")
    infer_stream = add("infer_stream", "Run a streamed inference (StreamPredictions), printing as it arrives.")
    infer_stream.add_argument("model_input", help="Input for model for stream inference.")
    infer_stream2 = add(
        "infer_stream2",
        "Send a sequence of inputs over one StreamPredictions2 stream (stateful inference).",
    )
    infer_stream2.add_argument("sequence_id", help="Input for sequence id for stream inference.")
    infer_stream2.add_argument("input_files", help="Comma separated list of input files")
    add("unregister", "Unregister a model (version).")
    return parser


def load_key(key_file: str, section: str) -> str:
    """Return ``[section]["key"]`` of a TorchServe key_file.json.

    Raises ClientError if the file cannot be read or has no such key.
    """
    try:
        with open(key_file, encoding="utf-8") as f:
            keys = json.load(f)
    except (OSError, ValueError) as e:
        raise ClientError(f"cannot read key file {key_file}: {e}") from e
    entry = keys.get(section) if isinstance(keys, dict) else None
    key = entry.get("key") if isinstance(entry, dict) else None
    if not isinstance(key, str) or not key:
        raise ClientError(f"key file {key_file} has no {section!r} key")
    return key


def build_metadata(auth_token: str | None, key_file: str | None, section: str) -> tuple[tuple[str, str], ...]:
    """Call metadata for an API ("inference" or "management").

    TorchServe's client metadata, plus ``authorization: Bearer <token>`` where a
    token is given (``auth_token`` wins over the ``section`` key of ``key_file``).
    """
    token = auth_token
    if not token and key_file:
        token = load_key(key_file, section)
    if token:
        return BASE_METADATA + (("authorization", f"Bearer {token}"),)
    return BASE_METADATA


def tls_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials | None:
    """Channel credentials from ``--tls-ca`` / ``--tls-cert`` / ``--tls-key`` (``None``: plaintext).

    Without ``--tls-ca`` the system's trusted CAs are used.  Raises ClientError
    if a file cannot be read or only one of ``--tls-cert`` / ``--tls-key`` is given.
    """
    if ca is None and cert is None and key is None:
        return None
    if (cert is None) != (key is None):
        raise ClientError("--tls-cert and --tls-key go together")

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise ClientError(f"cannot read TLS file {path}: {e.strerror or e}") from e

    return grpc.ssl_channel_credentials(
        root_certificates=read(ca), private_key=read(key), certificate_chain=read(cert)
    )


def make_channel(host: str, port: int, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """Open a channel to ``host:port`` (IPv6 literals bracketed): TLS with ``credentials``, else insecure."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    if credentials is not None:
        return grpc.secure_channel(f"{host}:{port}", credentials, options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(f"{host}:{port}", options=CHANNEL_OPTIONS)


def read_input(path: str) -> bytes:
    """Read an input file; raises ClientError if it cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ClientError(f"cannot read input file {path}: {e.strerror or e}") from e


def resolve_register_url(model_name: str, mar_set: str | None) -> str:
    """The ``url`` of RegisterModel for ``register <model_name> [mar_set]``.

    No mar_set: ``<model_name>.mar`` (a file in the server's model store).  One
    location: that location.  A comma separated ``[model_name=]model_location``
    list (TorchServe's format): the entry named ``model_name``, else the entry
    that is ``<model_name>.mar``, else ``<model_name>.mar``.
    """
    marfile = f"{model_name}.mar"
    if not mar_set or not mar_set.strip():
        return marfile
    entries = [e.strip() for e in mar_set.split(",") if e.strip()]
    unnamed: list[str] = []
    for entry in entries:
        m = _NAMED_ENTRY.match(entry)
        if m is None:
            unnamed.append(entry)
        elif m.group(1) == model_name:
            return m.group(2)
    for entry in unnamed:
        if entry.rstrip("/").rsplit("/", 1)[-1] == marfile:
            return entry
    if len(entries) == 1 and unnamed:
        return unnamed[0]
    return marfile


def _print_rpc_error(err: grpc.RpcError) -> None:
    """Print ``error: <StatusCode name>: <details>`` to stderr."""
    code = err.code() if callable(getattr(err, "code", None)) else None
    details = err.details() if callable(getattr(err, "details", None)) else None
    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    print(f"error: {name}: {details or ''}", file=sys.stderr)


def _status_code_name(code: int) -> str:
    """Name of a numeric gRPC status code (e.g. 13 -> "INTERNAL")."""
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status.name
    return str(code)


@contextlib.contextmanager
def _cancel_on_exit(call: grpc.Future | grpc.Call) -> Iterator[None]:
    """Cancel ``call`` if the block is left by an exception (e.g. Ctrl-C)."""
    try:
        yield
    except BaseException:
        call.cancel()
        raise


def register(
    stub: management_pb2_grpc.ManagementAPIsServiceStub,
    model_name: str,
    mar_set: str | None,
    metadata: Sequence[tuple[str, str]],
    timeout: float | None,
    out: TextIO,
) -> int:
    """RegisterModel (synchronous, one initial worker); print the server's msg."""
    request = management_pb2.RegisterModelRequest(
        model_name=model_name,
        url=resolve_register_url(model_name, mar_set),
        initial_workers=1,
        synchronous=True,
    )
    future = stub.RegisterModel.future(request, metadata=metadata, timeout=timeout)
    with _cancel_on_exit(future):
        response = future.result()
    print(response.msg or f"Model {model_name} registered successfully", file=out)
    return EXIT_OK


def unregister(
    stub: management_pb2_grpc.ManagementAPIsServiceStub,
    model_name: str,
    model_version: str | None,
    metadata: Sequence[tuple[str, str]],
    timeout: float | None,
    out: TextIO,
) -> int:
    """UnregisterModel; print the server's msg."""
    request = management_pb2.UnregisterModelRequest(model_name=model_name, model_version=model_version or "")
    future = stub.UnregisterModel.future(request, metadata=metadata, timeout=timeout)
    with _cancel_on_exit(future):
        response = future.result()
    print(response.msg or f"Model {model_name} unregistered successfully", file=out)
    return EXIT_OK


def _prediction_request(
    model_name: str, model_version: str | None, data: bytes, sequence_id: str | None = None
) -> inference_pb2.PredictionsRequest:
    """A PredictionsRequest with ``input={"data": data}``."""
    request = inference_pb2.PredictionsRequest(
        model_name=model_name, model_version=model_version or "", input={"data": data}
    )
    if sequence_id is not None:
        request.sequence_id = sequence_id
    return request


def infer(
    stub: inference_pb2_grpc.InferenceAPIsServiceStub,
    model_name: str,
    model_input: str,
    model_version: str | None,
    metadata: Sequence[tuple[str, str]],
    timeout: float | None,
    out: TextIO,
) -> int:
    """Predictions with the file's bytes as ``data``; print the prediction as text."""
    request = _prediction_request(model_name, model_version, read_input(model_input))
    future = stub.Predictions.future(request, metadata=metadata, timeout=timeout)
    with _cancel_on_exit(future):
        response = future.result()
    print(response.prediction.decode("utf-8", errors="replace"), file=out)
    return EXIT_OK


def infer_stream(
    stub: inference_pb2_grpc.InferenceAPIsServiceStub,
    model_name: str,
    model_input: str,
    model_version: str | None,
    metadata: Sequence[tuple[str, str]],
    timeout: float | None,
    out: TextIO,
) -> int:
    """StreamPredictions; print each piece the moment it arrives.

    Pieces are concatenated (a streamed LLM answer appears token by token; a
    UTF-8 character split across pieces is decoded whole) and a newline ends
    the output unless it already ends with one. The bundled LLM handler's usage
    message (the last message when the request asks ``include_usage``: a JSON
    object with ``finish_reason`` and ``usage``) is not printed as text: its
    ``text`` is, the answer's line is ended, and then
    ``finish_reason: ..., prompt_tokens: ..., completion_tokens: ...`` goes to stderr.
    A message of that shape that is not the last one is text.
    """
    request = _prediction_request(model_name, model_version, read_input(model_input))
    call = stub.StreamPredictions(request, metadata=metadata, timeout=timeout)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    last = ""
    held: tuple[bytes, dict[str, Any]] | None = None  # a usage-shaped message, until the stream shows it was last

    def show(data: bytes) -> None:
        nonlocal last
        text = decoder.decode(data)
        if text:
            print(text, end="", file=out, flush=True)
            last = text

    try:
        with _cancel_on_exit(call):
            for response in call:
                if held is not None:
                    show(held[0])
                    held = None
                usage = usage_message(response.prediction)
                if usage is not None:
                    held = (response.prediction, usage)
                else:
                    show(response.prediction)
        if held is not None:  # the stream's last message: the usage, not text
            show(held[1]["text"].encode("utf-8"))
            if last and not last.endswith("\n"):
                show(b"\n")  # the answer's line ends before the usage
            counts = held[1]["usage"]
            print(f"finish_reason: {held[1]['finish_reason']}, prompt_tokens: {counts.get('prompt_tokens')}, "
                  f"completion_tokens: {counts.get('completion_tokens')}", file=sys.stderr, flush=True)
            held = None
    finally:
        if held is not None:  # the stream failed after a usage-shaped message: it was text
            show(held[0])
        text = decoder.decode(b"", final=True)
        if text:
            last = text
        if last and not last.endswith("\n"):
            text += "\n"
        if text:
            print(text, end="", file=out, flush=True)
    return EXIT_OK


def usage_message(data: bytes) -> dict[str, Any] | None:
    """The bundled LLM handler's usage object (``{"text", "finish_reason", "usage": {...}}``)
    if ``data`` is one, else ``None``."""
    if not data.startswith(b"{") or b'"finish_reason"' not in data:
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    if (isinstance(obj, dict) and isinstance(obj.get("text"), str) and isinstance(obj.get("finish_reason"), str)
            and isinstance(obj.get("usage"), dict)):
        return obj
    return None


def infer_stream2(
    stub: inference_pb2_grpc.InferenceAPIsServiceStub,
    model_name: str,
    sequence_id: str,
    input_files: str,
    model_version: str | None,
    metadata: Sequence[tuple[str, str]],
    timeout: float | None,
    out: TextIO,
) -> int:
    """StreamPredictions2: one request per file of ``input_files``, in order.

    Each response's prediction is printed on its own line as it arrives; a
    response carrying a non-zero ``status`` is printed to stderr instead and
    makes the exit status 1.  The client half-closes its side only once it has
    received a response for each request (TorchServe ends the call when the
    client half-closes), then prints whatever else the server sends until it
    ends the stream.
    """
    paths = [p.strip() for p in input_files.split(",") if p.strip()]
    if not paths:
        raise ClientError("no input files given")
    payloads = [read_input(p) for p in paths]
    all_answered = threading.Event()

    def requests() -> Iterator[inference_pb2.PredictionsRequest]:
        """Yield the sequence's requests, then hold the stream open until answered."""
        for data in payloads:
            yield _prediction_request(model_name, model_version, data, sequence_id)
        all_answered.wait()

    call = stub.StreamPredictions2(requests(), metadata=metadata, timeout=timeout)
    received = failed = 0
    try:
        with _cancel_on_exit(call):
            for response in call:
                received += 1
                if response.HasField("status") and response.status.code != 0:
                    failed += 1
                    code = response.status.code
                    print(
                        f"error: {_status_code_name(code)} ({code}): {response.status.message}",
                        file=sys.stderr,
                        flush=True,
                    )
                else:
                    text = response.prediction.decode("utf-8", errors="replace")
                    print(text, file=out, flush=True)
                if received >= len(payloads):
                    all_answered.set()
    finally:
        all_answered.set()
    return EXIT_ERROR if failed else EXIT_OK


DEFAULT_RUN_DIR = ".inference_service"
DEFAULT_INFERENCE_PORT = 7070
DEFAULT_MANAGEMENT_PORT = 7071


def find_server(args: argparse.Namespace) -> None:
    """Fill the ports and key file left unset on the command line from the run directory's
    ``status.json`` (see the module docstring), else TorchServe's default ports.

    Raises ClientError when ``--run-dir`` is given and has no readable status file.
    """
    run_dir = Path(args.run_dir or DEFAULT_RUN_DIR)
    status_path = run_dir / "status.json"
    try:
        status = json.loads(status_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        if args.run_dir is not None:
            raise ClientError(f"no server status in {status_path} ({getattr(e, 'strerror', None) or e}): "
                              "is a server running with that --run-dir?") from e
        status = {}
    if not isinstance(status, dict):
        status = {}
    if args.inference_port is None:
        args.inference_port = status.get("inference_port") or DEFAULT_INFERENCE_PORT
    if args.management_port is None:
        args.management_port = status.get("management_port") or DEFAULT_MANAGEMENT_PORT
    if args.key_file is None and not args.auth_token and status.get("key_file"):
        args.key_file = status["key_file"]


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Run the parsed subcommand; RPC and local errors propagate to the caller."""
    find_server(args)
    credentials = tls_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    if args.action in ("register", "unregister"):
        metadata = build_metadata(args.auth_token, args.key_file, "management")
        with make_channel(args.host, args.management_port, credentials) as channel:
            mgmt = management_pb2_grpc.ManagementAPIsServiceStub(channel)
            if args.action == "register":
                return register(mgmt, args.model_name, args.mar_set, metadata, args.timeout, out)
            return unregister(mgmt, args.model_name, args.model_version, metadata, args.timeout, out)
    metadata = build_metadata(args.auth_token, args.key_file, "inference")
    with make_channel(args.host, args.inference_port, credentials) as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        if args.action == "infer":
            return infer(
                stub,
                args.model_name,
                args.model_input,
                args.model_version,
                metadata,
                args.timeout,
                out,
            )
        if args.action == "infer_stream":
            return infer_stream(
                stub,
                args.model_name,
                args.model_input,
                args.model_version,
                metadata,
                args.timeout,
                out,
            )
        return infer_stream2(
            stub,
            args.model_name,
            args.sequence_id,
            args.input_files,
            args.model_version,
            metadata,
            args.timeout,
            out,
        )


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run it, return the exit status."""
    args = build_parser().parse_args(argv)
    out = sys.stdout
    if hasattr(out, "reconfigure"):  # never die on an unencodable character
        out.reconfigure(errors="replace")
    try:
        return run(args, out)
    except grpc.RpcError as e:
        _print_rpc_error(e)
        return EXIT_ERROR
    except ClientError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("\ncancelled", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
