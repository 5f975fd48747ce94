"""The gateway: an OpenAI-compatible HTTP front (FastAPI on uvicorn) that tokenizes, routes each
request to a decode worker from the Redis registry, and streams its tokens back."""
