"""``${name}`` placeholders in config.pbtxt files, filled the way
TensorRT-LLM's repository is (``fill_template.py -i config.pbtxt a:1,b:2``).

Every placeholder must receive a value and every value must name a
placeholder of the file, so a typo fails loudly instead of shipping a config
with a literal ``${...}`` or a setting that was never applied.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping

_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def placeholders(text: str) -> set[str]:
    return set(_PLACEHOLDER.findall(text))


def parse_assignments(text: str) -> dict[str, str]:
    """'a:1,b:two' -> {'a': '1', 'b': 'two'} (values may contain ':')."""
    values = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition(":")
        if not sep or not name:
            raise ValueError(f"expected name:value, got {item!r}")
        values[name.strip()] = value.strip()
    return values


def fill(text: str, values: Mapping[str, object], *, source: str = "template") -> str:
    """Substitute every ${name} (other `$` text is left alone); raise ValueError on a missing or unknown name."""
    wanted = placeholders(text)
    missing = sorted(wanted - set(values))
    unknown = sorted(set(values) - wanted)
    if missing:
        raise ValueError(f"{source}: no value for {', '.join(missing)}")
    if unknown:
        raise ValueError(f"{source}: no placeholder named {', '.join(unknown)}")
    return _PLACEHOLDER.sub(lambda match: str(values[match.group(1)]), text)


def fill_file(path: Path, values: Mapping[str, object], output: Path | None = None) -> Path:
    """Fill `path` in place (or into `output`)."""
    text = fill(Path(path).read_text(), values, source=str(path))
    target = Path(output or path)
    target.write_text(text)
    return target
