"""``${name}`` placeholders in config.pbtxt files, filled the way
TensorRT-LLM's repository is (``fill_template.py -i config.pbtxt a:1,b:2``).

Every placeholder must receive a value and every value must name a
placeholder of the file, so a typo fails loudly instead of shipping a config
with a literal ``${...}`` or a setting that was never applied.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Mapping

from .install import project_file

_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def placeholders(text: str) -> set[str]:
    return set(_PLACEHOLDER.findall(text))


#: a comma that separates assignments: one not escaped by a backslash
_SEPARATOR = re.compile(r"(?<!\\),")


def parse_assignments(text: str) -> dict[str, str]:
    """'a:1,b:two' -> {'a': '1', 'b': 'two'} (values may contain ':'; a
    comma in a value is written ``\\,``, as TensorRT-LLM's fill_template.py
    takes it); a name given twice is refused."""
    values = {}
    for item in filter(None, (part.strip() for part in _SEPARATOR.split(text))):
        name, sep, value = item.partition(":")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"expected name:value, got {item!r}")
        if name in values:
            raise ValueError(f"{name} is given twice")
        values[name] = value.strip().replace("\\,", ",")
    return values


def escaped(value: object) -> str:
    """`value` as the inside of a config.pbtxt string literal (protobuf's
    text format reads C escapes there); a number or a Triton name has none
    of these characters, so unquoted placeholders take it unchanged."""
    return (str(value).replace("\\", "\\\\").replace('"', '\\"')
            .replace("\n", "\\n"))


def fill(text: str, values: Mapping[str, object], *, source: str = "template") -> str:
    """Substitute every ${name} (other `$` text is left alone); raise ValueError on a missing or unknown name."""
    wanted = placeholders(text)
    missing = sorted(wanted - set(values))
    unknown = sorted(set(values) - wanted)
    if missing:
        raise ValueError(f"{source}: no value for {', '.join(missing)}")
    if unknown:
        raise ValueError(f"{source}: no placeholder named {', '.join(unknown)}")
    return _PLACEHOLDER.sub(lambda match: escaped(values[match.group(1)]), text)


def fill_file(path: Path, values: Mapping[str, object], output: Path | None = None) -> Path:
    """Fill `path` in place (or into `output`)."""
    text = fill(Path(path).read_text(), values, source=str(path))
    target = Path(output or path)
    target.write_text(text)
    return target


def write_model(repository: Path, name: str, template: str, values: Mapping[str, object]) -> Path:
    """Copy model_repository/<template> to repository/<name>, filling its config."""
    target = repository / name
    shutil.copytree(project_file(f"model_repository/{template}"), target, dirs_exist_ok=True)
    fill_file(target / "config.pbtxt", values)
    return target
