"""The edit / agentic workload (specserve/tools/bench/edit_workload.py)."""

from specserve.tools.bench.edit_workload import SAMPLE, generate, render
from specserve.tools.bench.workload import parse_prompts


def test_shipped_file_is_the_generators_output():
    assert SAMPLE.read_text() == render(generate()), \
        "regenerate: python -m specserve.tools.bench.edit_workload"


def test_the_bench_reads_it_and_every_category_is_there():
    prompts = parse_prompts(SAMPLE.read_text().splitlines(), str(SAMPLE))
    cats = {p.category for p in prompts}
    assert cats == {"edit", "json_fix", "code_edit", "trace", "multi_turn", "family"}
    assert render(generate(seed=1)) != render(generate())  # the seed matters
    # A family's requests share most of their text.
    fam = [p.text for p in prompts if p.category == "family"]
    assert len(fam) >= 2 and fam[0] != fam[1]
    assert sum(a == b for a, b in zip(fam[0], fam[1])) > 0.8 * len(fam[0])
