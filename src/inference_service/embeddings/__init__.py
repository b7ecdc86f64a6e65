"""Text embedding models served by a batching handler (OpenAI's ``/v1/embeddings`` and every other
door). See docs/embeddings.md.

Importing this package imports neither torch nor OpenVINO; the submodules do where needed.
"""
