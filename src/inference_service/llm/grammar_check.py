"""Structured outputs checked against a budget before they reach the shared step.

A constraint is compiled against the model's vocabulary (XGrammar's token mask cache) and its
token masks are computed during the step that every running request shares (the OpenVINO
pipeline does both inside ``step``). Some short constraints are costly there: ``.{0,5000}``
takes about 11 s to compile against SmolLM2's 49,152 tokens. So every constraint is first tried in
a grammar-checker process beside the worker: compiled, then walked for :data:`WALK_TOKENS`
tokens, each mask timed. A constraint whose compile and walk take more CPU time than its
budget, whose masks take longer each than the per-token budget, or whose compiled form is larger
than the size budget is refused (400 naming the field and the budget) before any engine sees it.

The checker process (``python -m inference_service.llm.grammar_check``) holds the vocabulary
and forks one child per check. The kernel holds the child to its CPU budget (``ITIMER_PROF``:
SIGPROF ends it), so a constraint costs the worker's machine at most its budget, and a child
over budget is gone when its 400 is sent. Frames on the checker's pipes are a 4-byte big-endian
length and UTF-8 JSON.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import IO, Any

from inference_service.contracts.request_error import InvalidRequest
from inference_service.contracts.structured import StructuredOutputs

#: Tokens of a constraint walked in the check, each mask timed (a random path through the grammar).
WALK_TOKENS = 24
#: Verdicts kept (least recently used dropped first), of constraints up to :data:`KEPT_CHARS` long:
#: a constraint sent again (the same schema on every request) is not tried again.
KEPT_VERDICTS = 512
KEPT_CHARS = 4096
#: Seconds a check may take on the clock before it is refused, beyond its CPU budget times this
#: factor (a backstop for a loaded machine: the CPU budget is what a constraint is held to).
WALL_FACTOR = 4.0


@dataclass(frozen=True)
class ConstraintBudget:
    """What one constraint may cost (handler config keys ``structured_outputs_budget_ms``,
    ``structured_outputs_token_budget_ms``, ``structured_outputs_max_mb``).

    Attributes:
        cpu_s: CPU seconds to compile it and walk :data:`WALK_TOKENS` tokens.
        token_s: CPU seconds of the costliest token mask of the walk.
        max_bytes: size of its compiled form (its token mask cache).
    """

    cpu_s: float = 5.0
    token_s: float = 0.050
    max_bytes: int = 16 << 20

    @property
    def wall_s(self) -> float:
        """Seconds on the clock after which a check is refused whatever its CPU time."""
        return self.cpu_s * WALL_FACTOR + 1.0


class GrammarChecker:
    """The worker's side of the grammar-checker process: :meth:`check` one constraint at a time.

    Args:
        vocabulary: returns XGrammar's ``TokenizerInfo.serialize_json()`` of the model's vocabulary
            (called at the first :meth:`check`: about 1 s).
        budget: what a constraint may cost.

    The process starts at the first :meth:`check` (about 4 s: XGrammar imports torch) and is
    started anew if it dies. Thread-safe: checks wait for each other.
    """

    def __init__(self, vocabulary: Callable[[], str], budget: ConstraintBudget) -> None:
        self.budget = budget
        self._vocabulary = vocabulary
        self._info: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[tuple[StructuredOutputs, ConstraintBudget], str | None] = OrderedDict()

    def check(self, spec: StructuredOutputs) -> None:
        """Try ``spec`` in the checker within :attr:`budget`.

        Raises:
            InvalidRequest: it does not compile, or it is over a budget (names the field and the budget).
            RuntimeError: the checker process could not be started or answered out of protocol.
        """
        key = (spec, self.budget)
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                refusal = self._verdicts[key]
            else:
                answer = self._ask({"spec": asdict(spec), "budget": asdict(self.budget)})
                refusal = answer.get("refused")
                if not answer.get("busy") and len(json.dumps(asdict(spec))) <= KEPT_CHARS:
                    self._verdicts[key] = refusal
                    if len(self._verdicts) > KEPT_VERDICTS:
                        self._verdicts.popitem(last=False)
        if refusal is not None:
            raise InvalidRequest(f"'structured_outputs.{spec.kind}': {refusal}", "structured_outputs")

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        for attempt in (1, 2):  # a checker that died since the last check is started anew once
            proc = self._process()
            try:
                assert proc.stdin is not None and proc.stdout is not None
                _write_frame(proc.stdin, request)
                answer = _read_frame(proc.stdout, time.monotonic() + self.budget.wall_s + 10.0)
            except (OSError, EOFError, TimeoutError, ValueError):
                self.close()
                if attempt == 2:
                    raise RuntimeError("the grammar checker process stopped answering") from None
                continue
            return answer
        raise AssertionError("unreachable")

    def _process(self) -> subprocess.Popen[bytes]:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            return proc
        if self._info is None:
            self._info = self._vocabulary()
        # one thread: a thread pool's spinning would count against each check's CPU budget
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "inference_service.llm.grammar_check"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert proc.stdin is not None and proc.stdout is not None
        _write_frame(proc.stdin, {"tokenizer_info": self._info})
        _read_frame(proc.stdout, time.monotonic() + 120.0)  # ready: XGrammar imported, vocabulary read
        self._proc = proc
        return proc

    def close(self) -> None:
        """Stop the checker process (a later :meth:`check` starts it again)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def _write_frame(stream: IO[bytes], value: dict[str, Any]) -> None:
    data = json.dumps(value).encode()
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def _read_exactly(fd: int, size: int, deadline: float) -> bytes:
    chunks, got = [], 0
    while got < size:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError("no answer in time")
        chunk = os.read(fd, size - got)
        if not chunk:
            raise EOFError("the pipe closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_frame(stream: IO[bytes], deadline: float) -> dict[str, Any]:
    fd = stream.fileno()
    (size,) = struct.unpack(">I", _read_exactly(fd, 4, deadline))
    value = json.loads(_read_exactly(fd, size, deadline))
    if not isinstance(value, dict):
        raise ValueError("a frame is not a JSON object")
    return value


# --- the checker process -------------------------------------------------------------------------

def _compile(compiler: Any, spec: StructuredOutputs) -> Any:
    from inference_service.llm.grammar import JSON_OPTIONS, choice_grammar

    schema = spec.schema()
    if schema is not None:
        return compiler.compile_json_schema(schema, **JSON_OPTIONS)
    if spec.regex is not None:
        return compiler.compile_regex(spec.regex)
    return compiler.compile_grammar(spec.grammar if spec.grammar is not None else choice_grammar(spec.choice or ()))


def _walk(compiled: Any, vocab_size: int, seed: int) -> float:
    """CPU seconds of the costliest token mask on a random path of :data:`WALK_TOKENS` tokens."""
    import numpy as np
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    pick = random.Random(seed)
    stops = set(matcher.stop_token_ids)
    worst = 0.0
    for _ in range(WALK_TOKENS):
        if matcher.is_terminated():
            break
        start = time.thread_time()
        matcher.fill_next_token_bitmask(bitmask)
        worst = max(worst, time.thread_time() - start)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab_size]
        allowed = np.flatnonzero(bits).tolist()
        going = [token for token in allowed if token not in stops] or allowed
        if not going or not matcher.accept_token(pick.choice(going)):
            break
    return worst


def _try(info: Any, spec: StructuredOutputs, budget: ConstraintBudget) -> dict[str, Any]:
    """The checker child's answer for ``spec``: ``{}`` (within budget) or ``{"refused": reason}``."""
    import xgrammar

    from inference_service.llm.grammar import refusal_reason

    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    try:
        compiled = _compile(compiler, spec)
    except (RuntimeError, ValueError) as exc:
        return {"refused": refusal_reason(spec, exc)}
    size = int(compiled.memory_size_bytes)
    if size > budget.max_bytes:
        return {"refused": f"compiles to {size / 2**20:.1f} MB against this model's vocabulary, over the "
                           f"budget of {budget.max_bytes / 2**20:g} MB (structured_outputs_max_mb)"}
    worst = _walk(compiled, info.vocab_size, seed=len(json.dumps(asdict(spec))))
    if worst > budget.token_s:
        return {"refused": f"takes {worst * 1000:.0f} ms of CPU time per generated token, over the budget of "
                           f"{budget.token_s * 1000:g} ms (structured_outputs_token_budget_ms)"}
    return {}


def _over_budget(budget: ConstraintBudget, clock: bool = False) -> dict[str, Any]:
    if clock:
        return {"refused": f"did not compile against this model's vocabulary within {budget.wall_s:g} s on the "
                           "clock (the machine is busy, or the constraint is costly: "
                           f"structured_outputs_budget_ms is {budget.cpu_s * 1000:g} ms of CPU time)",
                "busy": True}  # the clock's verdict, not the constraint's: not kept
    return {"refused": f"takes over {budget.cpu_s * 1000:g} ms of CPU time to compile against this model's "
                       "vocabulary (the budget, structured_outputs_budget_ms)"}


def _check_in_child(info: Any, spec: StructuredOutputs, budget: ConstraintBudget) -> dict[str, Any]:
    """Fork a child that tries ``spec`` under a CPU-time limit; its answer, or a refusal if it ran out."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: held to the CPU budget by the kernel
        os.close(read_fd)
        code = 0
        try:
            signal.signal(signal.SIGPROF, signal.SIG_DFL)
            signal.setitimer(signal.ITIMER_PROF, budget.cpu_s)
            data = json.dumps(_try(info, spec, budget)).encode()
            os.write(write_fd, data)
        except BaseException:  # noqa: BLE001 - the parent reports a child that answered nothing
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    deadline = time.monotonic() + budget.wall_s
    data = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_fd], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return _over_budget(budget, clock=True)
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGPROF, signal.SIGXCPU):
        return _over_budget(budget)
    if not data:
        return {"refused": "could not be compiled (the grammar compiler failed on it)"}
    answer = json.loads(data)
    return answer if isinstance(answer, dict) else {"refused": "could not be compiled"}


def main() -> None:
    """The checker process: read the vocabulary, then answer one check per frame until stdin closes."""
    import numpy  # noqa: F401 - imported once here, not in every child
    import torch
    import xgrammar

    import inference_service.llm.grammar  # noqa: F401

    torch.set_num_threads(1)

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    forever = time.monotonic() + 10 * 365 * 86400.0
    first = _read_frame(stdin, forever)
    info = xgrammar.TokenizerInfo.deserialize_json(first["tokenizer_info"])
    _write_frame(stdout, {"ready": True})
    while True:
        try:
            request = _read_frame(stdin, forever)
        except EOFError:
            return
        given: dict[str, Any] = request["spec"]
        spec = StructuredOutputs(json=given.get("json"), regex=given.get("regex"), grammar=given.get("grammar"),
                                 choice=tuple(given["choice"]) if given.get("choice") else None,
                                 json_object=bool(given.get("json_object")))
        _write_frame(stdout, _check_in_child(info, spec, ConstraintBudget(**request["budget"])))


if __name__ == "__main__":
    main()
