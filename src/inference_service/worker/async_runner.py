"""Async handlers in the worker: TorchServe's ``asyncCommunication: true``.

One asyncio task per request on the worker's loop (as TorchServe's ``ts/async_service.py``),
each with a batch of one and its own copy of the context. A ``CANCEL`` cancels the task
(``CancelledError`` at the handler's ``await``, so an engine such as vLLM's aborts). Not
flow-controlled: ``send_intermediate_predict_response`` runs on the loop and must not block.
See docs/own-model.md.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import threading
from typing import Any

from inference_service.contracts import wire
from inference_service.handler.context import Context
from inference_service.handler.encoding import encode_response
from inference_service.handler.streaming import RequestCancelled
from inference_service.worker import answers
from inference_service.worker.inputs import handler_request
from inference_service.worker.runtime import Worker


class AsyncRunner:
    """Runs a worker's ``async def handle`` once per request, concurrently."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.channel = worker.channel
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._stopped: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def serve(self) -> None:
        """Run until ``STOP`` or the channel closes."""
        try:
            loop = asyncio.get_event_loop()
        except RuntimeError:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
        loop.run_until_complete(self._main(loop))

    async def _main(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._stopped = loop.create_future()
        reader = threading.Thread(target=self._read, name="ipc-reader", daemon=True)
        reader.start()
        try:
            await self._stopped
        finally:
            for task in list(self.tasks.values()):
                task.cancel()
            if self.tasks:
                await asyncio.wait(list(self.tasks.values()), timeout=2.0)

    def _read(self) -> None:
        """Reader thread: every frame goes to the loop; the end of the channel stops it."""
        assert self._loop is not None
        while True:
            item = self.channel.read_frame()
            self._loop.call_soon_threadsafe(self._on_frame, item)
            if item is None or item[0] == wire.STOP:
                return

    def _on_frame(self, item: tuple[int, bytes] | None) -> None:
        assert self._stopped is not None
        if item is None or item[0] == wire.STOP:
            if not self._stopped.done():
                self._stopped.set_result(None)
            return
        kind, body = item
        if kind == wire.BATCH:
            decode = self.worker.spec.decode_input_request
            for request in wire.decode_batch(body):
                headers, inputs = handler_request(request, decode)
                rid = request.request_id
                self.tasks[rid] = asyncio.ensure_future(self._run(rid, request.sequence_id, headers, inputs))
        elif kind == wire.CANCEL:
            rid = body.decode()
            task = self.tasks.get(rid)
            if task is not None:
                self.channel.cancelled.add(rid)
                task.cancel()

    async def _run(self, rid: str, seq: str | None, headers: dict[str, Any], inputs: dict[str, Any]) -> None:
        """One request: call the handler, answer, forget the request."""
        worker = self.worker
        context: Context = copy.copy(worker.context)
        context.begin_batch([rid], [headers], [seq])
        try:
            frame = await self._answer(context, rid, inputs)
        except (asyncio.CancelledError, RequestCancelled):
            frame = answers.cancelled(rid)
        except Exception as exc:  # noqa: BLE001 - a handler bug fails this request, the worker lives on
            frame = answers.failed([rid], exc)[0]
        finally:
            self.tasks.pop(rid, None)
            self.channel.end([rid])
        metrics = self.channel.metrics
        if metrics is not None and metrics.pending:
            frame = wire.encode_metrics(metrics.drain()) + frame
        self.channel.send(frame)

    async def _answer(self, context: Context, rid: str, inputs: dict[str, Any]) -> bytes:
        """The request's last frame: FINAL with the result, or its status error; TypeError for other than
        one result, and whatever the handler raises."""
        assert self.worker.service is not None
        result = self.worker.service.handle([inputs], context)
        if inspect.isasyncgen(result):
            async for item in result:
                value = item[0] if isinstance(item, (list, tuple)) and len(item) == 1 else item
                if value is not None:
                    self.channel.send_intermediate(rid, encode_response(value), context.get_response_headers(0))
            result = [None]
        elif inspect.isawaitable(result):
            result = await result
        if not isinstance(result, (list, tuple)) or len(result) != 1:
            got = len(result) if isinstance(result, (list, tuple)) else type(result).__name__
            raise TypeError(f"handler returned {got} results for a batch of 1 request")
        return b"".join(self.channel.headers_frames(rid, context.get_response_headers(0))
                        + [answers.result(context, 0, rid, result[0])])
