"""`simple-sampler report` builds its Markdown and PNGs from small JSON inputs of
every kind: each bench's example output (bench/NAME/example.json) and perf's
two kinds (tests/fixtures/report/, see its README.md)."""
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
from matplotlib.image import imread  # noqa: E402

import simple_sampler.bench  # noqa: E402
from simple_sampler.bench import registry  # noqa: E402
from simple_sampler.bench.perf import figures_from_export  # noqa: E402
from simple_sampler.cli import main  # noqa: E402
from simple_sampler.report import ReportError, build, headings  # noqa: E402

BENCHES = Path(simple_sampler.bench.__file__).parent
PERF_FIXTURES = Path(__file__).parent / "fixtures" / "report"
INPUTS = sorted(BENCHES.glob("*/example.json")) + sorted(PERF_FIXTURES.glob("*.json"))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def example(bench: str) -> Path:
    """`bench NAME`'s example --json output, in its package."""
    return BENCHES / bench.replace("-", "_") / "example.json"


def load(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Path, str]:
    markdown = build(INPUTS, tmp_path_factory.mktemp("report"))
    return markdown, markdown.read_text()


def test_every_kind_gets_its_section(report):
    """Every registered bench (each has its example) and perf's two kinds, each
    section with its table."""
    assert [name for name in registry() if not example(name).is_file()] == []
    _, text = report
    drawn = {section.splitlines()[0]: section for section in re.split(r"^## ", text, flags=re.M)[1:]}
    assert set(drawn) == set(headings().values())
    assert set(registry()) < set(headings())
    for heading, section in drawn.items():
        assert re.search(r"^\|---\|", section, re.M), heading


def test_serve_cost_rows_show_cpu_by_process_and_the_ratio_to_the_floor(report):
    _, text = report
    for row in load(example("serve-cost"))["results"]:
        cpu = row["cpu_us_per_token"]
        assert (f"| {cpu['tritonserver']:,.0f} | {cpu['llm']:,.0f} | {cpu['floor']:,.0f} | "
                f"{cpu['samplers']:,.0f} |") in text
        assert f"| {row['vs_floor']:.2f}x | {row['server_vs_floor']:.2f}x |" in text
    assert "serve-cost-cpu-per-token.png" in text


def test_row_transport_rows_show_each_transport_beside_the_kernel(report):
    _, text = report
    for row in load(example("row-transport"))["results"]:
        fallback = "-" if row["fallback_rate"] is None else f"{row['fallback_rate']:.2%}"
        assert (f"| {row['transport']} | {row['vocab']:,} | {row['dtype']} | {row['batch']} | "
                f"{row['samplers_us_per_token']:,.1f} |") in text
        assert f"| {row['vs_kernel']:.2f}x | {fallback} |" in text
    assert "row-transport-cpu-per-token.png" in text


def test_figures_and_ratios_come_from_the_inputs(report):
    _, text = report
    # bench serve at concurrency 32: 112.5 against 52.1 tokens/s, P95 ITL 209 against 612 ms.
    assert "| 32 | 112.5 | 52.1 | 2.16x | 209 | 612 | 0.34x | 66% |" in text
    # perf at concurrency 8: the simple / inline ratio of the fixture's tokens/s.
    perf = {(r["mode"], r["concurrency"]): r for r in load(PERF_FIXTURES / "perf.json")["results"]}
    ratio = perf[("simple", 8)]["tokens_per_s"] / perf[("inline", 8)]["tokens_per_s"]
    simple, inline = perf[("simple", 8)]["tokens_per_s"], perf[("inline", 8)]["tokens_per_s"]
    assert f"| 8 | {simple:.1f} | {inline:.1f} | {ratio:.2f}x |" in text
    # kernels: simple against the floor, top_p and logprobs against the exp floor and
    # torch_sort against simple, per vocab and dtype.
    for row in load(example("kernels"))["results"]:
        us = row["us_per_row"]
        assert (f"| {us['floor']:,.1f} | {us['exp_floor']:,.1f} "
                f"| {us['simple'] / us['floor']:.2f}x | {us['simple_top_p'] / us['floor']:.2f}x "
                f"| {us['simple_top_p'] / us['exp_floor']:.2f}x "
                f"| {us['simple_logprobs'] / us['exp_floor']:.2f}x "
                f"| {us['torch_sort'] / us['simple']:.1f}x | {row['rows']} |") in text
    # shvs: full / shvs per row kind and config.
    for row in load(example("shvs"))["results"]:
        us = row["us_per_row"]
        assert f"| {row['rows']} | {row['vocab']} | {row['config']} |" in text
        assert f"| {us['full'] / us['shvs']:.2f}x |" in text
    # sampler-server: 2 instances against 1 and against in-process.
    assert "| 2 | 17,795 | 1.60x | 1.03x |" in text
    # the raw export's figures, computed as `simple-sampler perf` computes them
    figures = figures_from_export(load(PERF_FIXTURES / "simple-c2.json"))
    assert f"| simple-c2.json | 2 | {figures['tokens_per_s']:.1f} |" in text
    # serve-sim: efficiency and exposed sampling as a share of the step, labelled simulated.
    sim = load(example("serve-sim"))
    assert f"Data plane: **{sim['data_plane']}**" in text and sim["data_plane"].startswith(
        "simulated data plane")
    for row in sim["results"]:
        share = 100 * row["exposed_sampling_ms_per_step"] / row["step_ms"]
        assert (f"| {row['mode']} | {row['micro_batches']} | {row['batch']} | "
                f"{row['vocab']:,} | {row['dtype']} | {row['step_ms']:.1f} | "
                f"{row['tokens_per_s']:,.0f} | {row['ideal_tokens_per_s']:,.0f} | "
                f"{row['efficiency']:.3f} | {row['exposed_sampling_ms_per_step']:.2f} | "
                f"{share:.1f}% |") in text


def test_serve_sim_rows_show_their_shvs_acceptance_and_launch_ahead(tmp_path):
    """--shvs rows show the hot set's acceptance, rows without SHVS, and files
    from before the option, read off; rows launched ahead read on, files from
    before launch_ahead off."""
    sim = load(example("serve-sim"))
    sim["results"][0].update(shvs=True, shvs_acceptance=0.631, launch_ahead="on")
    for result in sim["results"][1:]:
        result.pop("launch_ahead", None)
    path = tmp_path / "serve_sim_shvs.json"
    path.write_text(json.dumps(sim))
    rows = [line for line in build([path], tmp_path / "out").read_text().splitlines()
            if line.startswith(("| simple |", "| inline_kernels |"))]
    assert len(rows) == len(sim["results"]) > 1
    assert rows[0].endswith("| 63.1% | on |")
    assert all(row.endswith("| off | off |") for row in rows[1:])


def test_every_input_names_its_command_machine_and_date(report):
    _, text = report
    for path in INPUTS:
        if path.name == "simple-c2.json":  # a raw export: no machine
            continue
        machine = load(path)["machine"]
        provenance = (f"Source: `{machine['command']}`; machine: {machine['cpu']}, "
                      f"{machine['cores']} cores; date: {machine['date']}.")
        assert provenance in text
    assert ("Source: `perf_analyzer --profile-export-file (simple-c2.json)`; machine unknown; "
            "date unknown.") in text
    # every figure's caption carries its source
    captions = re.findall(r"^\*Figure \d+: .*\*$", text, re.M)
    assert len(captions) == len(re.findall(r"^!\[", text, re.M)) == 14
    assert all("Source: `" in caption and "date" in caption for caption in captions)


def test_referenced_pngs_exist_and_are_images(report):
    markdown, text = report
    names = re.findall(r"^!\[[^\]]*\]\(([^)]+\.png)\)$", text, re.M)
    # sections in the benches' name order, then perf's
    assert {"01-kernels-float32.png", "02-kernels-bfloat16.png",
            "03-row-transport-cpu-per-token.png", "04-sampler-server.png",
            "05-serve-throughput.png", "06-serve-itl-p95.png", "07-serve-sampling-share.png",
            "08-serve-cost-cpu-per-token.png", "09-serve-sim-efficiency.png", "10-shvs.png",
            "11-perf-throughput.png", "12-perf-itl-p95.png", "13-perf-export-throughput.png",
            "14-perf-export-itl-p95.png"} == set(names)
    assert sorted(p.name for p in markdown.parent.glob("*.png")) == sorted(names)
    for name in names:
        path = markdown.parent / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 10_000
        height, width, _ = imread(path).shape
        assert (width, height) == (700, 420)


def test_only_the_plots_with_inputs_are_made(tmp_path):
    markdown = build([example("kernels")], tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["01-kernels-float32.png",
                                                               "02-kernels-bfloat16.png"]
    assert "## SHVS" not in markdown.read_text()


def test_kernels_runs_without_the_exp_floor_show_it_as_missing(tmp_path):
    """A run whose kernels predate the exp floor (scripts/kernels_ab.sh's
    "before" side) renders, its exp-floor cells n/a."""
    kernels = load(example("kernels"))
    for row in kernels["results"]:
        del row["us_per_row"]["exp_floor"]
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(kernels))
    rows = [line for line in build([path], tmp_path / "out").read_text().splitlines()
            if line.startswith(("| 49152 |", "| 4096 |"))]
    assert len(rows) == len(kernels["results"])
    assert all(row.split(" | ").count("n/a") == 3 for row in rows)


def test_unknown_json_names_the_file(tmp_path):
    unknown = tmp_path / "mystery.json"
    unknown.write_text(json.dumps({"results": [{"what": 1}]}))
    with pytest.raises(ReportError, match=r"mystery\.json: not a recognized benchmark JSON"):
        build([example("serve"), unknown], tmp_path / "out")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ReportError, match=r"broken\.json: cannot read it as JSON"):
        build([broken], tmp_path / "out")


def test_cli_writes_the_report_and_prints_its_path(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["report", *map(str, INPUTS), "--output-dir", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out / "report.md")
    assert (out / "report.md").is_file() and len(list(out.glob("*.png"))) == 14


def test_cli_reports_an_unknown_input(tmp_path, capsys):
    unknown = tmp_path / "mystery.json"
    unknown.write_text("{}")
    assert main(["report", str(unknown), "--output-dir", str(tmp_path / "out")]) == 2
    assert "mystery.json: not a recognized benchmark JSON" in capsys.readouterr().err
