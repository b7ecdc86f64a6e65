"""Sequences kept by the server between a client's requests: TorchServe's job groups over HTTP.

A stateful model (``sequenceBatching: true``) pins each sequence to one worker
(:meth:`ModelVersion.open_sequence`). Over gRPC a sequence lives as long as its
StreamPredictions2 call; over HTTP each request stands alone, so the server holds the sequence
from the request that opens it until the handler ends it (the response header
``ts_request_sequence_end``, or the client's request header ``ts_request_sequence_end: true``), it
is idle ``sequenceMaxIdleMSec`` with no request running, or ``sequenceTimeoutMSec`` passed since it
opened. A request without ``ts_request_sequence_id`` opens one under a new ``ts-seq-<uuid>``, with
``ts_request_sequence_start: true`` for the handler, as TorchServe 0.12's InferenceRequestHandler.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass

from inference_service.errors import NotFound

#: TorchServe's header names (``ts_header_key_sequence_*`` defaults).
SEQ_ID = "ts_request_sequence_id"
SEQ_START = "ts_request_sequence_start"
SEQ_END = "ts_request_sequence_end"
#: How many ended ids of this server's own minting are remembered (refused when named again).
ENDED_KEPT = 10_000


def new_sequence_id() -> str:
    """A fresh sequence id in TorchServe's form ``ts-seq-<uuid>``."""
    return f"ts-seq-{uuid.uuid4()}"


@dataclass
class Held:
    """One held sequence; times are ``time.monotonic()``."""

    opened: float
    last_used: float
    running: int = 0


class SequenceBook:
    """The held sequences of one model version.

    Args:
        idle_ms: ``sequenceMaxIdleMSec`` (0: never idle out).
        timeout_ms: ``sequenceTimeoutMSec`` (0: no limit from the opening).
    """

    def __init__(self, idle_ms: int, timeout_ms: int) -> None:
        self.idle_s = idle_ms / 1000
        self.timeout_s = timeout_ms / 1000
        self.held: dict[str, Held] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # minted id -> why it ended

    def check(self, sequence_id: str) -> None:
        """Refuse a sequence this server minted and has since closed.

        Raises:
            NotFound: the sequence ended or expired (HTTP 404).
        """
        why = self._ended.get(sequence_id)
        if why is not None:
            raise NotFound(f"sequence {sequence_id} is no longer open: {why}", reason="SEQUENCE_CLOSED")

    def why_overdue(self, sequence_id: str, now: float) -> str | None:
        """Why the held sequence is past its idle or total limit, or ``None``."""
        held = self.held.get(sequence_id)
        if held is None:
            return None
        if self.timeout_s and now - held.opened >= self.timeout_s:
            return f"it passed sequenceTimeoutMSec={self.timeout_s * 1000:g}"
        if self.idle_s and not held.running and now - held.last_used >= self.idle_s:
            return f"it was idle past sequenceMaxIdleMSec={self.idle_s * 1000:g}"
        return None

    def overdue(self, now: float) -> list[tuple[str, str]]:
        """Every held sequence past its limits, with why (nothing is closed here)."""
        return [(seq, why) for seq in self.held if (why := self.why_overdue(seq, now)) is not None]

    def enter(self, sequence_id: str, now: float) -> None:
        """A request of ``sequence_id`` starts (the sequence is held from now on)."""
        held = self.held.get(sequence_id)
        if held is None:
            held = self.held[sequence_id] = Held(now, now)
        held.running += 1
        held.last_used = now

    def leave(self, sequence_id: str, now: float) -> None:
        """A request of ``sequence_id`` ended, however."""
        held = self.held.get(sequence_id)
        if held is not None:
            held.running = max(0, held.running - 1)
            held.last_used = now

    def close(self, sequence_id: str, why: str) -> None:
        """Forget a held sequence; an id of this server's minting is refused from now on."""
        self.held.pop(sequence_id, None)
        if sequence_id.startswith("ts-seq-"):
            self._ended[sequence_id] = why
            if len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
