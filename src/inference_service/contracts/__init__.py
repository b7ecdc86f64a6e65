"""What crosses a process or a front door, declared once and typed (docs/architecture.md).

Imports nothing of this package beyond ``errors``, and no torch: every room may import it.
"""
