"""Reading the config file: bounded read, YAML that refuses a key given twice, keys that must be names."""

from __future__ import annotations

import os
from typing import Any

import yaml

from hicache_canary.settings.config_errors import ConfigError
from hicache_canary.files import MAX_CONFIG_BYTES, FileTooLarge, read_text


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one silently:
    a second `targets:` block would drop the first list without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults` then an explicit key: overriding a merged key is the point
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get((type(key), key))  # typed: 1 and true are different keys to a reader
            except TypeError:
                continue  # an unhashable key: SafeLoader's own error names it
            line = key_node.start_mark.line + 1
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {first}); give each key once", key_node.start_mark
                )
            seen[(type(key), key)] = line
        return super().construct_mapping(node, deep=deep)


def _key_problems(value: Any, where: str = "") -> list[str]:
    """Keys that are not text (`1:`, `yes:`), reported by their value, not as a list index `[1]`."""
    problems: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                if isinstance(k, bool):
                    shown, kind = str(k).lower(), "a boolean"
                elif isinstance(k, (int, float)):
                    shown, kind = repr(k), "a number"
                else:
                    shown, kind = repr(k), "null" if k is None else f"a {type(k).__name__}"
                problems.append(f"{where + '.' if where else ''}{shown}: unknown key ({kind}, not a name)")
            else:
                problems += _key_problems(v, f"{where}.{k}" if where else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            problems += _key_problems(v, f"{where}[{i}]")
    return problems


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The config document as a mapping ({} for an empty file); ConfigError on anything else."""
    try:
        text = read_text(path, MAX_CONFIG_BYTES)
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read config: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not UTF-8 text (byte {exc.start}); save the config as UTF-8"]) from None
    except FileTooLarge as exc:
        raise ConfigError([f"{exc}; not a config file?"]) from None
    try:
        doc = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError([f"{path}:{where}: {problem}"]) from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError([f"{path}: the top level must be a mapping, not {type(doc).__name__}"])
    problems = _key_problems(doc)
    if problems:
        raise ConfigError(problems)
    return doc
