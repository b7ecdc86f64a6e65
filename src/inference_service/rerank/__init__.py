"""Cross-encoder models served by a batching handler: rerank and score (``/v1/rerank``,
``/v1/score`` and every other door). See docs/rerank.md.

Importing this package imports neither torch nor OpenVINO; the submodules do where needed.
"""
