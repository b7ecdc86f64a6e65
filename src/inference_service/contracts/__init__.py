"""What crosses a process or a front door, declared once and typed (docs/architecture.md).

``wire``: the frames between the server and a worker process; ``cpu``: the CPUs and the
default worker threads; ``sampling``: one LLM request's typed parameters; ``outputs``: the
LLM's final message; ``stats``: the engine statistics every metric is derived from. Imports
nothing of this package beyond ``errors``, and no torch: every room may import it.
"""
