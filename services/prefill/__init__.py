"""The prefill worker: chunked prefill whose finished KV blocks are pushed to a decode worker while
later chunks compute; returns the first token."""
