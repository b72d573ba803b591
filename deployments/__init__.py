"""Ray Serve deployments of specserve: Router (ingress), TargetServer, DraftServer,
and `app.build_app`, the one place they are wired into Serve."""
