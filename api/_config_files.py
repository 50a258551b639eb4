"""Config files as plain data: TOML, JSON and YAML, read as data and nothing more.

YAML aliases are checked before anything is built from them: a document whose aliases
expand to more than `MAX_YAML_NODES` nodes (a "billion laughs" bomb is 500 bytes) or
that refers to itself is refused in one line, in the time it takes to count, not to expand.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec

from .errors import ConfigError

MAX_YAML_NODES = 100_000
MAX_CONFIG_BYTES = 1 << 20  # checked before parsing: a config is a few hundred bytes


def _yaml_loader() -> Any:
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    # YAML 1.1 reads `1e-3` (no dot) as a string; read it as a float, as TOML and JSON do.
    exponent_only = re.compile(r"^[-+]?\d[\d_]*[eE][-+]?\d+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", exponent_only, list("-+0123456789"))
    return Loader


def _expanded_size(node: Any, sizes: dict[int, int], open_: set[int]) -> int:
    """Nodes in `node` once every alias is expanded; raises on a node that contains itself."""
    import yaml

    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise ValueError(f"line {node.start_mark.line + 1}: an alias refers to the node that contains it")
    open_.add(key)
    if isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    else:
        children = []
    size = 1
    for child in children:
        size += _expanded_size(child, sizes, open_)
        if size > MAX_YAML_NODES:
            raise ValueError(f"aliases expand to more than {MAX_YAML_NODES:,} nodes; a config needs no such thing")
    open_.discard(key)
    sizes[key] = size
    return size


def _count_events(data: bytes) -> None:
    """Refuse a document of more than `MAX_YAML_NODES` nodes before any node is built (parse events are cheap)."""
    import yaml

    count = 0
    for event in yaml.parse(data, Loader=_yaml_loader()):
        if isinstance(event, (yaml.ScalarEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent, yaml.AliasEvent)):
            count += 1
            if count > MAX_YAML_NODES:
                raise ValueError(f"more than {MAX_YAML_NODES:,} values; a config needs no such thing")


def _read_yaml(data: bytes) -> Any:
    _count_events(data)
    loader = _yaml_loader()(data)
    try:
        node = loader.get_single_node()
        if node is None:
            return {}
        _expanded_size(node, {}, set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _string_keys(data: Any, path: Path, where: str = "") -> Any:
    """`data`, refused (naming the table) where a table has a key that is not a string (YAML's `1: 2`)."""
    if isinstance(data, dict):
        for key, value in data.items():
            if not isinstance(key, str):
                raise ConfigError(
                    where, f"unknown field {key!r} (a key must be a name, not {type(key).__name__})", str(path)
                )
            _string_keys(value, path, f"{where}.{key}" if where else key)
    elif isinstance(data, list):
        for item in data:
            _string_keys(item, path, where)
    return data


def read_config_file(path: Path) -> Any:
    """The plain data in a `.toml`, `.yaml`/`.yml` or `.json` config file."""
    if not path.is_file():
        raise ConfigError("", "no such config file", str(path))
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ConfigError("", f"unknown config format {suffix!r}; use .toml, .yaml, .yml or .json", str(path))
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(
                "", f"{path.stat().st_size:,} bytes; a config file is at most {MAX_CONFIG_BYTES:,}", str(path)
            )
        data = path.read_bytes()
        if suffix == ".toml":
            return _string_keys(msgspec.toml.decode(data), path)
        if suffix == ".json":
            return _string_keys(msgspec.json.decode(data), path)
        return _string_keys(_read_yaml(data), path)
    except ConfigError:
        raise
    except OSError as e:
        raise ConfigError("", f"cannot read: {e.strerror}", str(path)) from None
    except Exception as e:  # each parser has its own error type
        detail = " ".join(str(e).split())
        raise ConfigError("", f"not valid {suffix[1:].upper()}: {detail}", str(path)) from None
