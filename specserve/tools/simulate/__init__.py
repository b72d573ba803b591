"""`specserve simulate`: the capacity simulator (pure) and its command line."""
