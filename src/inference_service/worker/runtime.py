"""The loaded handler of a worker process (:class:`Worker`) and TorchServe's default way
to run it: one batch at a time, answered with ``FINAL``/``ERROR`` frames and ``DONE``.

Wherever a running handler can observe a cancel, the frames that arrived meanwhile are taken
first without blocking (at most every :data:`~inference_service.worker.channel.POLL_INTERVAL_S`).
"""

from __future__ import annotations

import inspect
from typing import Any

from inference_service.contracts import wire
from inference_service.handler.context import Context
from inference_service.handler.encoding import encode_response
from inference_service.handler.metrics import Metrics
from inference_service.handler.streaming import RequestCancelled
from inference_service.worker import answers
from inference_service.worker.channel import WorkerChannel
from inference_service.worker.inputs import handler_request
from inference_service.worker.loader import Service, load_service


class Worker:
    """Runs one loaded :class:`Service` over a :class:`WorkerChannel`."""

    def __init__(self, channel: WorkerChannel, spec: wire.WorkerSpec) -> None:
        self.channel = channel
        self.spec = spec
        self.context = Context(
            model_name=spec.model_name,
            model_dir=spec.model_dir,
            manifest=spec.manifest,
            batch_size=spec.batch_size,
            gpu=spec.gpu,
            server_version=spec.server_version,
            limit_max_image_pixels=spec.limit_max_image_pixels,
            max_response_size=spec.max_response_size,
            metrics=Metrics(spec.model_name),
            model_yaml_config=spec.model_yaml_config,
        )
        self.context.bind_channel(channel)
        channel.metrics = self.context.metrics  # serving statistics always go to the frontend
        if spec.forward_metrics:
            self.context.metrics.forward()
        self.service: Service | None = None

    def load(self) -> None:
        """Load the handler. Raises HandlerLoadError with the cause."""
        self.service = load_service(self.spec.handler, self.spec.model_dir, self.context, self.spec.envelope)

    @property
    def handler_object(self) -> Any:
        """The handler instance (``None`` for a ``module:function`` entry point)."""
        return self.service.instance if self.service is not None else None

    def serve(self) -> None:
        """Main thread: run batches one at a time until ``STOP`` or the channel closes; record
        cancels between them (TorchServe's default mode)."""
        channel = self.channel
        while (item := channel.read_frame()) is not None:
            kind, body = item
            if kind == wire.BATCH:
                self.run_batch(body)
            elif kind == wire.CANCEL:
                channel.cancelled.add(body.decode())
            elif kind == wire.STOP:
                return

    def call_handler(self, data: list[dict[str, Any]], ids: list[str]) -> list[Any]:
        """One result per request of the batch (a generator's items go out as intermediate responses);
        TypeError for another count, and whatever the handler raises."""
        assert self.service is not None
        result = self.service.handle(data, self.context)
        if inspect.isgenerator(result):
            result = self._drain_generator(result, ids)
        if result is None:
            result = [None] * len(ids)
        if not isinstance(result, (list, tuple)) or len(result) != len(ids):
            got = len(result) if isinstance(result, (list, tuple)) else type(result).__name__
            raise TypeError(f"handler returned {got} results for a batch of {len(ids)} requests")
        self.channel.poll()
        return list(result)

    def run_batch(self, body: bytes) -> None:
        """Run one batch through the handler and answer every request in it, then ``DONE``."""
        batch = wire.decode_batch(body)
        ids = [request.request_id for request in batch]
        decode = self.spec.decode_input_request
        requests = [handler_request(request, decode) for request in batch]
        self.context.begin_batch(ids, [headers for headers, _ in requests], [r.sequence_id for r in batch])
        self.channel.begin(ids)
        data: list[dict[str, Any]] = [inputs for _, inputs in requests]
        out: list[bytes] = []
        cancelled = self.channel.cancelled
        try:
            result = self.call_handler(data, ids)
            for idx, rid in enumerate(ids):
                if rid in cancelled:
                    out.append(answers.cancelled(rid))
                else:
                    out += self.channel.headers_frames(rid, self.context.get_response_headers(idx))
                    out.append(answers.result(self.context, idx, rid, result[idx]))
        except RequestCancelled:
            out = [answers.cancelled(rid) for rid in ids]
        except Exception as exc:  # noqa: BLE001 - a handler bug answers INTERNAL, the worker lives on
            out = answers.failed(ids, exc)
        self.channel.end(ids)
        out += self.channel.pending_metrics()
        out.append(wire.frame(wire.DONE))
        self.channel.send(b"".join(out))

    def _drain_generator(self, gen: Any, ids: list[str]) -> Any:
        """Send each yielded list as intermediate responses; return the generator's return value."""
        cancelled = self.channel.cancelled
        try:
            while True:
                item = next(gen)
                if not isinstance(item, (list, tuple)) or len(item) != len(ids):
                    raise TypeError(
                        f"generator handler yielded {type(item).__name__} instead of a list of "
                        f"{len(ids)} entries"
                    )
                live = 0
                self.channel.poll_due()  # take the cancels that arrived meanwhile
                for idx, (rid, value) in enumerate(zip(ids, item, strict=True)):
                    if rid in cancelled:
                        continue
                    live += 1
                    if value is not None:
                        self.channel.send_intermediate(rid, encode_response(value),
                                                       self.context.get_response_headers(idx))
                if live == 0:
                    gen.close()
                    raise RequestCancelled("all requests of this batch were cancelled")
        except StopIteration as stop:
            return stop.value
        finally:
            gen.close()

