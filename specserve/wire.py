"""The draft <-> target wire, below both sides: its limits, its call metadata,
how a client channel to a draft sink is set up, and how the packed batches
(DraftBatch, VerifiedBatch) are built and read.

The target side (`specserve.target.sink`) and the draft side
(`specserve.draft.link`) both import from here and never from each other.
The messages themselves are proto/specserve/v1/spec.proto (generated code in
`specserve.v1`).
"""

from __future__ import annotations

from collections.abc import Callable

# gRPC refuses bigger messages; a prompt of 1M tokens fits in ~5 MiB.
MAX_MESSAGE_BYTES = 8 << 20
DRAFT_NAME_KEY = "x-specserve-draft"  # call metadata: "model/replica" of a draft
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def channel_factory(tls) -> Callable[[str], object]:
    """address -> an asyncio gRPC channel to a draft sink; tls: a
    specserve.tls.TlsFiles for mutual TLS (None: plaintext)."""
    import grpc

    from specserve import tls as tls_mod

    options = list(CHANNEL_OPTIONS)
    if tls is None:
        return lambda a: grpc.aio.insecure_channel(a, options=options)
    creds = tls_mod.channel_credentials(tls)  # read once: a missing file fails here
    options += tls_mod.channel_options(tls)
    return lambda a: grpc.aio.secure_channel(a, creds, options=options)


def pack_verified(verified):
    """A VerifiedBatch from a book's packed verified tokens
    (specserve.target.book_entry.Verified)."""
    from specserve.v1 import spec_pb2

    return spec_pb2.VerifiedBatch(request_ids=verified.keys,
                                  positions=verified.positions.tolist(),
                                  counts=verified.counts.tolist(),
                                  token_ids=verified.tokens.tolist(),
                                  held=verified.held.tolist())


def pack_drafts(windows: dict, done=()):
    """A DraftBatch from {request id: (position, tokens, [(fork, tokens), ...])};
    done: the request ids whose window ends what their draft has for now."""
    from specserve.v1 import spec_pb2

    ids, positions, counts, tokens = [], [], [], []
    owner, forks, bcounts, btokens = [], [], [], []
    done_at = []
    for i, (rid, (position, toks, branches)) in enumerate(windows.items()):
        ids.append(rid)
        positions.append(position)
        counts.append(len(toks))
        tokens += toks
        if rid in done:
            done_at.append(i)
        for fork, bt in branches:
            owner.append(i)
            forks.append(fork)
            bcounts.append(len(bt))
            btokens += bt
    return spec_pb2.DraftBatch(request_ids=ids, positions=positions, counts=counts,
                               token_ids=tokens, branch_of=owner, fork_positions=forks,
                               branch_counts=bcounts, branch_token_ids=btokens, done=done_at)


def unpack_verified(batch) -> list[tuple[str, int, list[int], int]]:
    """(request id, position, tokens, held) of each request in a VerifiedBatch
    (held: where the sink's drafts for it end; 0 when the sink did not say)."""
    tokens = list(batch.token_ids)
    held = list(batch.held) or [0] * len(batch.request_ids)
    out, at = [], 0
    for rid, position, n, h in zip(batch.request_ids, batch.positions, batch.counts, held):
        out.append((rid, position, tokens[at : at + n], h))
        at += n
    return out
