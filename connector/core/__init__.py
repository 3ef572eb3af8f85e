"""What decides, pure: a prompt's keys and hashes, what a lookup asks and finds, object headers,
watermarks, the cost model, tensor-parallel ranks. No store, no threads, no vLLM."""
