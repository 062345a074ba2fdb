"""Names of the model's own nodes, for errors raised by a fused kernel.

A plan step names its kernel node; for a fused kernel that is the group
(`fused_<anchor>`), while the user knows the op inside it. The artifact's
graph.json holds each group's body, whose nodes are named `<group>/<node>`
(names and types only: no tensor data). Read only when an error is being reported.
"""
from __future__ import annotations

import json
from pathlib import Path

GRAPH_FILE = "graph.json"


def member_name(directory: Path, node: str, op_type: str, input_name: str) -> str:
    """The name of the `op_type` node inside kernel node `node` that reads `input_name` (else the first
    `op_type` node in it); `node` itself when it is no fused group or graph.json cannot tell."""
    try:
        with open(Path(directory) / GRAPH_FILE, encoding="utf-8") as file:
            nodes = json.load(file)["graph"]["nodes"]
        group = next(n for n in nodes if n.get("name") == node)
        body = group["attrs"]["body"]["graph"]["nodes"]
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return node
    prefix = f"{node}/"
    members = [m for m in body if m.get("op_type") == op_type]
    reading = [m for m in members if f"{prefix}{input_name}" in m.get("inputs", ())]
    chosen = (reading or members or [None])[0]
    if chosen is None or not isinstance(chosen.get("name"), str):
        return node
    name = chosen["name"]
    return name[len(prefix):] if name.startswith(prefix) else name
