"""Llama-family model with a paged KV cache, and its weight loaders."""
