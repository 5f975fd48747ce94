"""The decode worker: continuous batching over the paged KV cache, tokens streamed over gRPC."""
