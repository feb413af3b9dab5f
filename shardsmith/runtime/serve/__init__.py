"""Serving: the launcher and rank supervisor, the engine thread, the OpenAI-compatible HTTP API,
tokenizer and chat formats, metrics, and ``generate``."""
