"""Why a run reached a branch that cannot run, in the user's terms: which graph input steered the If there.

The compiler replaces a branch that cannot run with the bound shapes by a node that stops the run with a
message (op Unreachable). When a run stops there and the If's condition is computed from graph inputs the
user did not give (random inputs), the input to set is named instead of the branch's inner failure.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator

from tessel.runtime.graph_names import GRAPH_FILE

UNREACHABLE = "Unreachable"


def unrunnable_branch_hint(directory: Path, message: str, guessed: Iterable[str]) -> str | None:
    """One line naming the input in `guessed` (inputs the run made up) that sent an If to the branch whose
    failure `message` tells (a worker's error line holds it); None when the failure is no such branch, or the
    graph cannot tell."""
    try:
        graph = json.loads((Path(directory) / GRAPH_FILE).read_text())["graph"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    guessed = set(guessed)
    for node in graph.get("nodes", []):
        if node.get("op_type") != "If" or not node.get("inputs"):
            continue
        if not any(_stops_with(n, message) for n in _unreachable_nodes(node)):
            continue
        steering = sorted(_graph_inputs_behind(graph, node["inputs"][0]) & guessed)
        if not steering:
            return None
        names = " and ".join(f"'{name}'" for name in steering)
        settings = " ".join(f"--input-value {name}=VALUE" for name in steering)
        return (f"random input {names} sent the If at node '{node['name']}' to a branch that cannot run; "
                f"give the value the model expects: {settings} (or --inputs IN.npz)")
    return None


def _unreachable_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The Unreachable nodes in the branches of `node`, nested Ifs included."""
    for attr in node.get("attrs", {}).values():
        if isinstance(attr, dict) and isinstance(attr.get("graph"), dict):
            for inner in attr["graph"].get("nodes", []):
                if inner.get("op_type") == UNREACHABLE:
                    yield inner
                yield from _unreachable_nodes(inner)


def _stops_with(node: dict[str, Any], message: str) -> bool:
    """Whether the Unreachable `node` is what stopped a run that failed with `message`."""
    text = node.get("attrs", {}).get("message")
    return isinstance(text, str) and bool(text) and text in message


def _graph_inputs_behind(graph: dict[str, Any], value: str) -> set[str]:
    """The graph inputs `value` is computed from."""
    inputs = {i["name"] for i in graph.get("inputs", [])}
    producers = {out["name"]: n for n in graph.get("nodes", []) for out in n.get("outputs", [])}
    found, seen, pending = set(), set(), [value]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in inputs:
            found.add(name)
        elif name in producers:
            pending.extend(n for n in producers[name].get("inputs", []) if n)
    return found
