"""docs/results/README.md indexes every results file, and only existing ones."""
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def test_every_results_file_is_in_the_index_and_every_entry_exists():
    index = (RESULTS / "README.md").read_text()
    listed = set(re.findall(r"^\| \[([^\]]+\.md)\]\(\1\)", index, re.MULTILINE))
    present = {path.name for path in RESULTS.glob("*.md")} - {"README.md"}
    assert present, f"no results files found in {RESULTS}"
    assert present - listed == set(), "results files missing from docs/results/README.md"
    assert listed - present == set(), "docs/results/README.md lists files that do not exist"
