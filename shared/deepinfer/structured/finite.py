"""Whether a JSON schema admits a finite document: a `$ref` loop, or a `$ref` back to itself through required
properties or non-empty arrays, admits none (the grammar would run until max_tokens, or past the parser's limits).

    where = endless_part(schema)    # None, or where every document would have to go on: "#/properties/next
                                    # requires # again"

A schema *can end* when some finite value satisfies it: a boolean `true`, any `const` / `enum`, a type with no
required part (strings, numbers, ...), an object whose required properties can end, an array whose first
`minItems` items can end; `$ref` as its target, `allOf` when all can, `anyOf` / `oneOf` when one can. The answer is
the least fixpoint over the schema's nodes (a node is assumed endless until shown to end), so cycles settle.
Unresolvable and remote refs are assumed to end (the grammar compiler reports them). Structural only: a
pattern or numeric range no value matches is the grammar compiler's to find.
"""

from __future__ import annotations

from typing import Any

from deepinfer.structured.subschemas import subschemas

_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


class _Nodes:
    """Every schema node reachable from the root (through children and local refs), by id, with its path."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.paths: dict[int, str] = {}
        self.nodes: list[dict[str, Any]] = []
        stack: list[tuple[Any, str]] = [(root, "#")]
        while stack:
            node, path = stack.pop()
            if not isinstance(node, dict) or id(node) in self.paths:
                continue
            self.paths[id(node)] = path
            self.nodes.append(node)
            stack.extend((child, f"{path}/{key}") for key, child in subschemas(node))
            target = self.resolve(node)
            if isinstance(target, dict):
                stack.append((target, node["$ref"]))

    def resolve(self, node: dict[str, Any]) -> Any:
        """The local target of `node`'s $ref; None when it has none or it is not a local JSON pointer."""
        ref = node.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#") or (ref[1:2] not in ("", "/")):
            return None
        target: Any = self.root
        for part in ref[2:].split("/") if len(ref) > 1 else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return None
        return target


def endless_part(schema: Any) -> str | None:
    """None when a finite document satisfies `schema`, else where the endless part is (JSON pointers)."""
    nodes = _Nodes(schema)
    ends: dict[int, bool] = {}

    def can_end(child: Any) -> bool:
        return ends.get(id(child), False) if isinstance(child, dict) else child is not False

    changed = True
    while changed:  # least fixpoint: ends only grows, at most once per node
        changed = False
        for node in nodes.nodes:
            if not ends.get(id(node)) and _ends(node, nodes, can_end):
                ends[id(node)] = changed = True
    if can_end(schema):
        return None
    return _first_endless(schema, nodes, can_end)


def _needed(node: dict[str, Any], nodes: _Nodes) -> tuple[list[Any], list[Any], list[list[Any]]]:
    """(children that all must end, children of which one must end, per type the children it needs)."""
    every: list[Any] = []
    target = nodes.resolve(node)
    if target is not None:
        every.append(target)
    every.extend(node.get("allOf") or [])
    some = [*(node.get("anyOf") or []), *(node.get("oneOf") or [])]
    if "const" in node or "enum" in node:
        return every, some, [[]]
    declared = node.get("type")
    types = [declared] if isinstance(declared, str) else list(declared or _TYPES)
    return every, some, [_needed_by_type(node, t) for t in types]


def _needed_by_type(node: dict[str, Any], type_name: str) -> list[Any]:
    if type_name == "object":
        properties = node.get("properties") or {}
        fallback = node.get("additionalProperties", True)
        return [properties.get(name, fallback) for name in node.get("required") or [] if isinstance(name, str)]
    if type_name == "array":
        min_items = node.get("minItems", 0)
        prefix = node.get("prefixItems") or (node["items"] if isinstance(node.get("items"), list) else [])
        rest = node.get("items", True) if not isinstance(node.get("items"), list) else node.get("additionalItems", True)
        num_needed = min(min_items, len(prefix) + 1) if isinstance(min_items, int) else 0
        return [prefix[i] if i < len(prefix) else rest for i in range(num_needed)]
    return []


def _ends(node: dict[str, Any], nodes: _Nodes, can_end: Any) -> bool:
    every, some, by_type = _needed(node, nodes)
    if not all(can_end(child) for child in every):
        return False
    if some and not any(can_end(child) for child in some):
        return False
    return any(all(can_end(child) for child in needed) for needed in by_type)


def _first_endless(schema: Any, nodes: _Nodes, can_end: Any) -> str:
    """Follow endless children from the root until one comes back (the cycle) or is `false`; say where."""
    node, seen = schema, {id(schema)}
    while True:
        every, some, by_type = _needed(node, nodes)
        candidates = [c for c in every if not can_end(c)] or [c for c in some if not can_end(c)]
        candidates += [c for needed in by_type for c in needed if not can_end(c)]
        path = nodes.paths[id(node)]
        if not candidates:
            return path
        child = candidates[0]
        if not isinstance(child, dict):
            return f"{path} requires a part that allows nothing (false)"
        if id(child) in seen:
            return f"{path} requires itself" if child is node else f"{path} requires {nodes.paths[id(child)]} again"
        seen.add(id(child))
        node = child
