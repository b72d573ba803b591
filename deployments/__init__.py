"""Ray Serve deployments of specserve: Router (ingress), TargetServer, DraftServer,
and `app.build_app`, the one place they are wired into Serve."""


def replica_name() -> str:
    """This Serve replica's id (the process id outside Serve)."""
    import os

    try:
        from ray import serve

        return serve.get_replica_context().replica_tag
    except Exception:
        return f"pid-{os.getpid()}"
