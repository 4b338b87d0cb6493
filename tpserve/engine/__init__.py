"""Engine: KV cache, scheduling, forward execution and sampling."""
