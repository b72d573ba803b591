"""The target side: the vLLM engine with the remote-draft proposer, its draft sink (gRPC) and the draft book that matches drafts to batch rows."""
