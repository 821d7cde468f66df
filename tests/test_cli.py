"""`simple-sampler bench ...`: the documented JSON objects, and the bench
subcommands built from the registry of bench specs."""
import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import simple_sampler.bench
from simple_sampler.bench import registry
from simple_sampler.bench.spec import given
from simple_sampler.cli import build_parser, main


@pytest.mark.slow
def test_bench_kernels_json(capsys):
    assert main(["bench", "kernels", "--json", "--vocab", "49152", "4096", "--batch", "4",
                 "--repeats", "2", "--no-peer"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["machine"]["cores"] >= 1 and report["machine"]["date"]
    results = report["results"]
    assert [(r["vocab"], r["dtype"]) for r in results] == [
        (49152, "float32"), (49152, "bfloat16"), (4096, "float32"), (4096, "bfloat16")]
    assert results[0]["rows"] == "smollm2" and results[2]["rows"].startswith("synthetic")
    for r in results:
        assert r["batch"] == 4
        us = r["us_per_row"]
        assert set(us) == {"simple", "simple_top_p", "simple_min_p", "simple_greedy",
                           "simple_logprobs", "simple_top_logprobs", "torch_sort", "floor",
                           "exp_floor"}
        assert all(value > 0 for value in us.values())
        assert r["ratios"]["simple_over_floor"] == pytest.approx(us["simple"] / us["floor"], rel=0.02)
        assert r["ratios"]["simple_logprobs_over_floor"] == pytest.approx(
            us["simple_logprobs"] / us["floor"], rel=0.02)
        assert r["ratios"]["simple_top_p_over_exp_floor"] == pytest.approx(
            us["simple_top_p"] / us["exp_floor"], rel=0.02)
        assert "vllm" not in r
        assert r["temperatures"] == {"simple": 0.8, "simple_top_p": 1.0, "simple_min_p": 1.0}
    worst = report["worst_over_floor"]
    assert set(worst) == {"simple", "simple_top_p", "simple_min_p", "simple_greedy",
                          "simple_logprobs", "simple_top_logprobs"}
    assert worst["simple"]["ratio"] == max(r["ratios"]["simple_over_floor"] for r in results)
    over_exp = report["worst_over_exp_floor"]
    assert set(over_exp) == set(worst)
    assert over_exp["simple_min_p"]["ratio"] == max(r["ratios"]["simple_min_p_over_exp_floor"]
                                                    for r in results)


@pytest.mark.slow
def test_bench_kernels_takes_several_temperatures_and_row_kinds(capsys):
    assert main(["bench", "kernels", "--json", "--vocab", "4096", "--batch", "4", "--dtype",
                 "float32", "--repeats", "2", "--no-peer", "--temperature", "1", "2",
                 "--rows", "flat", "heavy"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [(r["rows"].split()[0], r["temperatures"]["simple_top_p"]) for r in results] == [
        ("flat", 1.0), ("flat", 2.0), ("heavy", 1.0), ("heavy", 2.0)]
    assert all(set(r["temperatures"].values()) == {r["temperatures"]["simple"]} for r in results)
    assert main(["bench", "kernels", "--vocab", "4096", "--batch", "4", "--dtype", "float32",
                 "--repeats", "2", "--no-peer", "--temperature", "2"]) == 0
    table = capsys.readouterr().out
    assert "T: the temperature of every sampled config." in table
    assert table.splitlines()[2].split()[2] == "2"
    assert "worst ratio to the floor per config over this run (and to the exp floor):" in table
    assert re.search(r"^  simple_top_p .*x the exp floor", table, re.M)


@pytest.mark.slow
def test_bench_kernels_leaves_the_exp_floor_out_for_kernels_without_it(capsys, monkeypatch):
    """Kernels built before row_mass (scripts/kernels_ab.sh's "before" side):
    the run goes on without the exp floor and its ratios."""
    from simple_sampler import _sampling

    monkeypatch.delattr(_sampling, "row_mass")
    assert main(["bench", "kernels", "--json", "--vocab", "4096", "--batch", "4", "--dtype",
                 "float32", "--repeats", "2", "--no-peer"]) == 0
    report = json.loads(capsys.readouterr().out)
    (r,) = report["results"]
    assert "exp_floor" not in r["us_per_row"] and "simple_over_exp_floor" not in r["ratios"]
    assert report["worst_over_exp_floor"] == {} and report["worst_over_floor"]
    assert main(["bench", "kernels", "--vocab", "4096", "--batch", "4", "--dtype", "float32",
                 "--repeats", "2", "--no-peer"]) == 0
    assert "the exp floor  (" not in capsys.readouterr().out


def stand_in_peer(path: Path, script: str, version: dict, us: float) -> Path:
    """A python that answers only for `script` (its second argument, after -P),
    as the peer scripts do: one JSON line."""
    path.write_text("#!/bin/sh\n"
                    f"case \"$2\" in */{script}) ;; *) exit 4 ;; esac\n"
                    "case \"$3\" in *.npz) ;; *) exit 3 ;; esac\n"
                    f"echo '{json.dumps({'us_per_row': us, 'tokens': [], **version})}'\n")
    path.chmod(0o755)
    return path


@pytest.mark.slow
def test_bench_kernels_peer_columns_come_from_the_peers(tmp_path, capsys):
    """The vllm_cpu and sglang_cpu columns are what each peer's python reports,
    with its versions; stand-ins (vLLM and SGLang never run under make test)."""
    vllm = stand_in_peer(tmp_path / "vllm", "vllm_peer.py",
                         {"vllm_version": "0.32.0", "torch_version": "2.13.0+cpu"}, 5000.0)
    sglang = stand_in_peer(tmp_path / "sglang", "sglang_peer.py",
                           {"sglang_version": "0.5.23", "torch_version": "2.14.1+cu130"}, 7000.0)
    command = ["bench", "kernels", "--vocab", "4096", "--batch", "4", "--dtype", "bfloat16",
               "--repeats", "2", "--peer-python", str(vllm), "--sglang-python", str(sglang)]
    assert main([*command, "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["results"]
    us = r["us_per_row"]
    assert us["vllm_cpu"] == us["vllm_cpu_top_p"] == 5000.0
    assert us["sglang_cpu"] == us["sglang_cpu_top_p"] == 7000.0
    assert r["sglang"] == {"version": "0.5.23", "torch": "2.14.1+cu130"}
    assert r["vllm"] == {"version": "0.32.0", "torch": "2.13.0+cpu"}
    assert r["ratios"]["vllm_cpu_over_simple"] == pytest.approx(5000.0 / us["simple"], rel=0.05)
    assert r["ratios"]["sglang_cpu_top_p_over_simple_top_p"] == pytest.approx(
        7000.0 / us["simple_top_p"], rel=0.05)
    assert main(command) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].endswith(", vLLM 0.32.0, SGLang 0.5.23")
    assert "sglang/simple" in table.splitlines()[1]


def test_bench_kernels_finds_each_peer_and_no_peer_leaves_both_out(monkeypatch):
    """--peer-python / --sglang-python name the peers' pythons, each found by
    default_peer_python otherwise; --no-peer leaves both out. run() stubbed."""
    from simple_sampler.bench.kernels import SPEC, measuring

    calls = []
    monkeypatch.setattr(measuring, "default_peer_python", lambda peer="vllm": f"/default/{peer}")
    monkeypatch.setattr(measuring, "run", lambda **kwargs: calls.append(kwargs) or [])

    def peers(*options):
        SPEC.measure(build_parser().parse_args(["bench", "kernels", *options]))
        return calls[-1]["peer_python"], calls[-1]["sglang_python"]

    assert peers() == ("/default/vllm", "/default/sglang")
    assert peers("--sglang-python", "/s/python") == ("/default/vllm", "/s/python")
    assert peers("--peer-python", "/v/python") == ("/v/python", "/default/sglang")
    assert peers("--no-peer", "--sglang-python", "/s/python") == (None, None)


def test_default_peer_python_is_the_make_target_virtualenv(tmp_path, monkeypatch):
    """Where the peer's module does not import here, its `make` virtualenv's
    python when there is one (.peer/ for vLLM, .peer-sglang/ for SGLang)."""
    from simple_sampler.bench.kernels import measuring

    monkeypatch.setattr(measuring, "ROOT", tmp_path)
    monkeypatch.setitem(measuring.PEERS, "sglang", {**measuring.PEERS["sglang"],
                                                    "module": "no_such_module_sglang"})
    assert measuring.default_peer_python("sglang") is None
    python = tmp_path / ".peer-sglang" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    assert measuring.default_peer_python("sglang") == str(python)


def test_bench_requires_a_target():
    with pytest.raises(SystemExit):
        main(["bench"])


def test_bench_loop_json(capsys):
    assert main(["bench", "loop", "--json", "--batch", "4", "--history", "20",
                 "--steps", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["simulated"] is True and report["batch"] == 4
    assert [r["penalties"] for r in report["rows"]] == ["off", "on"]
    for row in report["rows"]:
        assert row["steps_run"] == 3  # one lane, every request in every step
        assert all(row[k] > 0 for k in ("loop_ms_batch_state", "loop_ms_rebuild",
                                         "batch_state_ms", "from_params_ms", "request_value_ms",
                                         "request_ref_ms", "decode_value_ms", "decode_ref_ms"))
    off, on = report["rows"]
    # histories named, not sent: only the penalized rows' request is smaller
    assert off["request_bytes_ref"] == off["request_bytes_value"]
    assert on["request_bytes_ref"] < on["request_bytes_value"]
    assert report["kind"] == "loop"


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def test_the_bench_subcommands_are_the_registry():
    """`bench NAME` for every bench package in bench/ and nothing else; each with
    --json, --quick where its spec says what it means, and its spec to run."""
    targets = subcommands(subcommands(build_parser())["bench"])
    assert list(targets) == list(registry()) and len(targets) >= 12
    for name, spec in registry().items():
        options = {action.dest for action in targets[name]._actions}
        assert "json" in options and ("quick" in options) == bool(spec.quick), name
        assert targets[name].get_default("spec") is spec


def test_every_bench_has_its_help_heading_and_measuring_module():
    package = Path(simple_sampler.bench.__file__).parent
    assert len(registry()) >= 10  # the registry found the benches
    for name, spec in registry().items():
        assert spec.help and spec.heading, name
        assert (package / name.replace('-', '_') / "measuring.py").is_file(), name
        assert all(callable(f) for f in (spec.arguments, spec.measure, spec.table, spec.section))


def test_an_option_left_out_keeps_the_run_default():
    """Options not given reach run() as its own defaults (one home each):
    given() passes only what the command line set."""
    args = build_parser().parse_args(["bench", "kernels", "--batch", "8"])
    assert given(args, batch="batch", vocabs="vocab", repeats="repeats") == {"batch": 8}


ROOT = Path(__file__).resolve().parents[1]
DOCUMENTED = [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.md")),
              *sorted((ROOT / "scripts").glob("*.sh"))]


def test_every_documented_bench_invocation_names_a_bench_and_its_options():
    """Each `simple-sampler bench NAME --option ...` in the docs, the Makefile
    and scripts/ names a registered bench and options it takes."""
    targets = subcommands(subcommands(build_parser())["bench"])
    found = 0
    for path in DOCUMENTED:
        # a script may continue the command line onto a line of its own
        start = r"(?:^\s*|simple-sampler |cli )" if path.suffix == ".sh" else r"simple-sampler "
        for line in path.read_text().splitlines():
            for name, rest in re.findall(start + r"bench ([a-z][a-z-]*)([^`]*)", line):
                assert name in targets, f"{path.name}: {line}"
                options = {o for a in targets[name]._actions for o in a.option_strings}
                unknown = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest)) - options
                assert not unknown, f"{path.name}: {line} ({unknown})"
                found += 1
    assert found > 30


def test_building_the_parser_imports_the_specs_alone():
    """Every bench's spec is imported to build the command line; their
    measuring modules (which may import torch) and the plain modules beside
    them (calibrate, perf, the helpers) are not, nor is torch."""
    code = ("import json, sys; from simple_sampler.cli import build_parser; build_parser(); "
            "print(json.dumps([m for m in sys.modules if m == 'torch' "
            "or m.startswith('simple_sampler.bench')]))")
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    specs = {f"simple_sampler.bench.{name.replace('-', '_')}" for name in registry()}
    assert set(json.loads(done.stdout)) == {"simple_sampler.bench", "simple_sampler.bench.spec",
                                            "simple_sampler.bench.markdown", *specs}
