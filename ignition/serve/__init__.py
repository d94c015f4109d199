"""The HTTP server: OpenAI-compatible endpoints over a loaded core (FastAPI + uvicorn)."""
