"""tpserve: tensor-parallel LLM inference server."""
