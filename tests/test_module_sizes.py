"""Files split by job (issue 45): no Python file in ``src/simple_sampler`` is
over 500 lines and no function over 80, so that a file that takes on a second
job shows up here instead of in a newcomer's first read."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "simple_sampler"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def sources() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def test_the_tree_has_sources():
    assert len(sources()) > 50, ROOT


def test_no_source_file_is_over_500_lines():
    long = {str(path.relative_to(ROOT)): lines for path in sources()
            if (lines := len(path.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"split these by job (lines): {long}"


def test_no_function_is_over_80_lines():
    long = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = lines
    assert not long, f"split these functions (lines): {long}"
