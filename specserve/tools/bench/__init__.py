"""`specserve bench`: target-only, vLLM's draft_model and specserve side by side."""
