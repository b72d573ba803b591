"""`specserve distill`: distilling a small draft from a target."""
