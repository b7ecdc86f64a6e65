"""Causal language models served by streaming handlers. See docs/llm.md.

Importing this package imports neither torch nor transformers; the submodules do where needed.
"""
