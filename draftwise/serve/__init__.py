"""Serving: continuous batching with speculative decoding behind an OpenAI-compatible HTTP API.

- ``engine.py``: the engine thread driving the one ``Decoder``; admission, KV-cache budget, queue, cancel.
- ``app.py``: FastAPI routes (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
  ``/metrics``), OpenAI error shape; ``protocol.py``: request bodies.
- ``detok.py``: incremental detokenization for streaming; ``metrics.py``: Prometheus metrics.
- ``server.py``: uvicorn in the foreground or a background thread; ``bench.py``: ``draftwise bench-serve``.
- The adaptive draft length policy is general and lives in ``draftwise/gamma.py``.
"""
