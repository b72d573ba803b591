"""The acceptance record: vLLM's per-request spec-decode figures, every figure derived from them, and their exporters."""
