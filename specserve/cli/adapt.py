"""The edge of `specserve adapt`: a draft pool's weight versions, from the shell.

Owns `specserve adapt status CONFIG --pool NAME` (the versions, which one
serves, each one's held-out alpha before and after and the guard's reason) and
`specserve adapt rollback CONFIG --pool NAME` (serve the version promoted
before the current one again; every replica of the pool loads it within
seconds, specserve.adapt.adapter), and `specserve adapt domain OUT` (the
tool-call domain of specserve.adapt.domain as two prompt files, its training
half and held-out half, for traffic and for `specserve bench --prompts`). Bad
input is one line, exit 2.
"""

from __future__ import annotations

import json

from specserve.cli.common import UsageError


def add_parser(sub) -> None:
    a = sub.add_parser("adapt", help="a draft pool's online-adapted weight versions: "
                       "status, rollback")
    asub = a.add_subparsers(dest="adapt_command", required=True, parser_class=type(a))
    d = asub.add_parser("domain", help="write the tool-call domain's training and held-out "
                        "halves as prompt files (Spec-Bench JSONL with a system message)")
    d.add_argument("out", help="folder to write train.jsonl and heldout.jsonl to (created)")
    d.add_argument("--train", type=int, default=2000, help="training prompts (default 2000)")
    d.add_argument("--heldout", type=int, default=64, help="held-out prompts (default 64)")
    d.add_argument("--seed", type=int, default=0)
    for name, text in (("status", "print the pool's versions and which one serves (JSON)"),
                       ("rollback", "serve the version promoted before the current one again")):
        c = asub.add_parser(name, help=text)
        c.add_argument("config", help="the app config file (YAML) the pool is in")
        c.add_argument("--pool", required=True, help="the draft pool's name")
        if name == "rollback":
            c.add_argument("--reason", default="rolled back by hand",
                           help="recorded in the manifest")


def write_domain(args) -> int:
    from pathlib import Path

    from specserve.adapt.domain import bench_lines, domain_split

    if args.train < 1 or args.heldout < 1:
        raise UsageError("--train and --heldout must be at least 1")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} exists and is not a folder")
    train, heldout = domain_split(args.train, args.heldout, seed=args.seed)
    out.mkdir(parents=True, exist_ok=True)
    for name, conversations in (("train", train), ("heldout", heldout)):
        (out / f"{name}.jsonl").write_text("".join(bench_lines(conversations, name)))
    print(f"{out}/train.jsonl ({len(train)} prompts), {out}/heldout.jsonl ({len(heldout)})")
    return 0


def run(args) -> int:
    from specserve.adapt.versions import MANIFEST, SHIPPED, VersionError, VersionStore

    if args.adapt_command == "domain":
        return write_domain(args)
    from specserve.config import AppConfig, ConfigError
    from specserve.models import DEFAULT_DRAFT_KEYWORD, default_draft_dir

    try:
        cfg = AppConfig.from_yaml(args.config)
    except (ConfigError, OSError) as e:
        raise UsageError(str(e)) from None
    pools = {d.name: d for d in cfg.drafts}
    pool = pools.get(args.pool)
    if pool is None:
        raise UsageError(f"no draft pool {args.pool!r} in {args.config}; its pools: "
                         f"{', '.join(sorted(pools)) or 'none'}")
    if not pool.adapt.enabled:
        raise UsageError(f"draft pool {args.pool!r} does not adapt (drafts[].adapt.enabled)")
    root = pool.adapt.versions_root(pool.name)
    if not (root / MANIFEST).is_file():
        raise UsageError(f"no versions yet at {root}: the pool has not served with adapt on")
    store = VersionStore(root)
    if args.adapt_command == "rollback":
        try:
            version = store.rollback(args.reason)
        except VersionError as e:
            raise UsageError(str(e)) from None
        print(f"{args.pool}: serving {version} (replicas load it within seconds)")
        return 0
    def folder(v: dict) -> str | None:
        """Where the version's weights are (a refused candidate's are not kept)."""
        if v["version"] == SHIPPED:  # the pool's model; "default" is the shipped draft's folder
            source = v.get("source")
            return str(default_draft_dir()) if source == DEFAULT_DRAFT_KEYWORD else source
        path = store.path(v["version"])
        return str(path) if path.is_dir() and any(path.iterdir()) else None

    versions = [{**v, "folder": folder(v)} for v in store.versions()]
    print(json.dumps({"pool": pool.name, "root": str(root), **store.figures(),
                      "versions": versions}, indent=1))
    return 0
