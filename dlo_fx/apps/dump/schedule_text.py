"""Readable one-line-per-node text of a scheduled graph (for golden tests and dumps)."""

from __future__ import annotations

from torch import fx


def _arg(a: object) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner})"
    return repr(a)


def _target(node: fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}"
    target = node.target
    return getattr(target, "__name__", str(target))


def describe(meta: dict) -> str:
    """The comment a schedule node carries: kind, block, slot, bytes (and FQNs for wait)."""
    kind = meta["kind"]
    if kind in ("slot_view", "resident"):
        stored = f", stored as {meta['stored_as']}" if meta.get("stored_as") else ""
        return f"{kind} {meta['fqn']} ({meta['bytes']} B{stored})"
    if kind == "cast":  # a stored dtype's cast, right after its slot view
        return f"cast {meta['fqn']} {meta['from']} -> {meta['to']}"
    text = f"{kind} block={meta['block']} slot={meta['slot']} bytes={meta['bytes']}"
    if meta.get("wrap"):
        text += " wrap-around"
    if kind == "wait":
        text += " covers " + ", ".join(meta["fqns"])
    return text


def format_schedule(gm: fx.GraphModule) -> str:
    """Every non-placeholder node on one line; schedule nodes show what they move."""
    lines = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        meta = node.meta.get("dlo")
        if meta is not None:
            if meta["kind"] == "slot_view":
                lines.append(f"{node.name} = slot_view({meta['fqn']})")
            elif meta["kind"] == "cast":
                lines.append(f"{node.name} = {_arg(node.args[0])}.to({meta['to']})")
            else:
                lines.append(f"{node.name}  # {describe(meta)}")
        elif node.op == "output":
            lines.append(f"return {_arg(node.args[0])}")
        elif node.op == "get_attr":
            lines.append(f"{node.name} = self.{node.target}")
        else:
            args = ", ".join(_arg(a) for a in node.args if isinstance(a, (fx.Node, list, tuple)))
            lines.append(f"{node.name} = {_target(node)}({args})")
    return "\n".join(lines)
