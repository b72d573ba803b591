"""Logging for specserve code running inside other programs' processes.

vLLM workers and Ray Serve replicas configure their own loggers only; messages
from `specserve.*` would be dropped there. `to_stderr` gives them a handler.
"""

import logging


def to_stderr(tag: str) -> None:
    root = logging.getLogger("specserve")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(asctime)s {tag} %(levelname)s %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
