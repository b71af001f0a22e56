"""Plan output: JSON-ready structures for ``--json`` and a terminal table."""

from __future__ import annotations

import io
import textwrap
from typing import Any

from rich.console import Console
from rich.table import Table

from .planner import DELETE, TRANSITION, CheckpointPlan, Plan

ELLIPSIS = "..."  # ASCII: the table must stay aligned in any terminal or log
_UNITS = ("B", "K", "M", "G", "T", "P", "E")


# --------------------------------------------------------------------------- JSON


def plan_to_json(plan: Plan, *, include_keys: bool = False) -> list[dict[str, Any]]:
    """One JSON object per checkpoint (the ``--json`` contract: a list).

    With ``include_keys`` each object also carries ``delete_batches`` (list of
    lists of keys, in execution order) and ``transition_keys``.
    """
    return [_entry_to_json(entry, include_keys) for entry in plan.checkpoints]


def _entry_to_json(entry: CheckpointPlan, include_keys: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "path": entry.path,
        "series": entry.series,
        "step": entry.step,
        "kind": entry.kind,
        "complete": entry.complete,
        "bytes": entry.bytes,
        "objects": entry.objects,
        "storage_class": entry.storage_class,
        "last_modified": entry.last_modified.isoformat(),
        "age_days": round(entry.age_days, 4),
        "action": entry.action,
        "target_class": entry.target_class,
        "reasons": list(entry.reasons),
        "objects_to_delete": len(entry.delete_keys),
        "objects_to_transition": len(entry.transition_objects),
    }
    if include_keys:
        out["delete_batches"] = [list(batch) for batch in entry.delete_batches]
        out["transition_keys"] = list(entry.transition_keys)
    return out


def summary_to_json(plan: Plan) -> dict[str, Any]:
    s = plan.summary
    return {
        "now": plan.now.isoformat(),
        "checkpoints": s.checkpoints,
        "kept": s.kept,
        "transitioned": s.transitioned,
        "deleted": s.deleted,
        "objects_deleted": s.objects_deleted,
        "bytes_deleted": s.bytes_deleted,
        "objects_transitioned": s.objects_transitioned,
        "bytes_transitioned": s.bytes_transitioned,
        "unmanaged_objects": s.unmanaged_objects,
        "unmanaged_bytes": s.unmanaged_bytes,
        "bytes_before": dict(s.bytes_before),
        "bytes_after": dict(s.bytes_after),
        "cost_before": s.cost_before,
        "cost_after": s.cost_after,
        "unpriced_classes": list(s.unpriced_classes),
        "warnings": list(plan.warnings),
    }


# --------------------------------------------------------------------------- formatting


def format_size(n: int) -> str:
    """Compact binary size, at most 5 characters: 512B, 1.5K, 37M, 1023G, 2.0T."""
    value = float(n)
    for unit in _UNITS:
        if unit == "B" and value < 1024:
            return f"{n}B"
        if unit != "B":
            text = f"{value:.1f}" if value < 9.95 else f"{value:.0f}"
            if float(text) < 1024 or unit == _UNITS[-1]:
                return text + unit
        value /= 1024
    raise AssertionError("unreachable")


def format_size_long(n: int) -> str:
    """Size for summary lines: 0 B, 512 B, 1.50 KiB, 37.2 GiB."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        value /= 1024
        text = f"{value:.3g}" if value < 100 else f"{value:.0f}"
        if float(text) < 1024 or unit == "EiB":
            return f"{text} {unit}"
    raise AssertionError("unreachable")


def format_age(days: float) -> str:
    """Compact age: 42m, 5.0h, 3.2d, 45d."""
    days = max(days, 0.0)
    if days < 1 / 24:
        return f"{days * 1440:.0f}m"
    if days < 1:
        return f"{days * 24:.1f}h"
    return f"{days:.1f}d" if days < 9.95 else f"{days:.0f}d"


def format_cost(dollars: float) -> str:
    return f"${dollars:,.2f}"


def elide_middle(text: str, width: int) -> str:
    """Shorten ``text`` to ``width`` by replacing its middle with '...'."""
    if len(text) <= width:
        return text
    if width <= len(ELLIPSIS):
        return text[:width]
    room = width - len(ELLIPSIS)
    head = room - room // 2
    return text[:head] + ELLIPSIS + text[len(text) - (room - head) :]


def elide_path(path: str, width: int) -> str:
    """Shorten a path to ``width`` keeping its last component (the checkpoint
    name) and as much of its head (the run) as fits: ``run-with-a-l.../step_1000``."""
    if len(path) <= width:
        return path
    if width <= len(ELLIPSIS):
        return path[len(path) - width :]
    room = width - len(ELLIPSIS)
    slash = path.rfind("/")
    tail = path[slash:] if slash >= 0 else path
    if len(tail) >= room:
        return ELLIPSIS + path[len(path) - room :]
    return path[: room - len(tail)] + ELLIPSIS + tail


# --------------------------------------------------------------------------- table

_ACTION_LABELS = {DELETE: "DELETE", TRANSITION: "tier"}
_SEP = "  "


def render_table(plan: Plan, width: int = 80) -> str:
    """A table with one row per checkpoint, then per-class totals and costs.

    Every line fits in ``width`` columns: long paths are elided in the middle
    (the checkpoint name is kept), reasons wrap onto continuation lines.
    """
    lines: list[str] = []
    if plan.checkpoints:
        lines.extend(_table_rows(plan, width))
    else:
        lines.append("no checkpoints found")
    lines.append("")
    lines.extend(_summary_lines(plan, width))
    # Last line of defence for very narrow widths.
    return "\n".join(line[:width].rstrip() for line in lines) + "\n"


def _table_rows(plan: Plan, width: int) -> list[str]:
    header = ("PATH", "SIZE", "CLASS", "AGE", "ACTION", "REASONS")
    rows = []
    for e in plan.checkpoints:
        cls = e.storage_class if e.storage_class else "-"
        rows.append(
            (
                e.path,
                format_size(e.bytes),
                elide_middle(cls, 12),
                format_age(e.age_days),
                _ACTION_LABELS.get(e.action, e.action),
                list(e.reasons) or ["-"],
            )
        )
    fixed = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in (1, 2, 3, 4)]
    fixed_total = sum(fixed) + len(_SEP) * 5
    available = max(width - fixed_total, 2)
    longest_path = max(len(header[0]), *(len(r[0]) for r in rows))
    longest_reason = max(len(header[5]), *(len(x) for r in rows for x in r[5]))
    # Reasons get room for the longest single reason when possible (e.g.
    # "tier:GLACIER_IR after 7d"); paths get the rest, but not so little that
    # the checkpoint name is lost.
    if longest_path + longest_reason <= available:
        path_w = longest_path
    else:
        path_w = max(available - min(longest_reason, 28), min(longest_path, 16, available // 2))
    reason_w = max(available - path_w, 1)

    table = Table(box=None, pad_edge=False, padding=(0, len(_SEP), 0, 0), show_edge=False)
    for name, justify in zip(header, ("left", "right", "left", "right", "left", "left")):
        table.add_column(name, justify=justify, no_wrap=True)
    for path, size, cls, age, action, reasons in rows:
        table.add_row(elide_path(path, path_w), size, cls, age, action, "\n".join(_wrap_items(reasons, reason_w)))
    return render_text(table, width).splitlines()


def render_text(renderable, width: int) -> str:
    """Plain text of a rich renderable at ``width`` columns (no colour: logs and pipes stay clean)."""
    console = Console(file=io.StringIO(), width=width, color_system=None, highlight=False, emoji=False)
    console.print(renderable)
    return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines())


def _wrap_items(items: list[str], width: int) -> list[str]:
    """Join items with ", " into lines of at most ``width``; never split an
    item unless it alone is too long (then it is shortened with '...')."""
    lines: list[str] = []
    current = ""
    for i, item in enumerate(items):
        text = item + ("," if i < len(items) - 1 else "")
        if len(text) > width:
            text = elide_middle(text, width)
        if not current:
            current = text
        elif len(current) + 1 + len(text) <= width:
            current += " " + text
        else:
            lines.append(current)
            current = text
    lines.append(current)
    return lines


def _summary_lines(plan: Plan, width: int) -> list[str]:
    s = plan.summary
    classes = list(s.bytes_before)
    label_w = max([len("storage class"), len("cost/month"), *(len(c) for c in classes)])
    priced = s.cost_before is not None

    totals = Table(box=None, pad_edge=False, padding=(0, 2, 0, 0), show_edge=False)
    totals.add_column("storage class", min_width=label_w, no_wrap=True)
    totals.add_column("before", justify="right", min_width=12, no_wrap=True)
    totals.add_column("after", justify="right", min_width=12, no_wrap=True)
    for cls in classes:
        totals.add_row(cls, format_size_long(s.bytes_before[cls]), format_size_long(s.bytes_after[cls]))
    totals.add_row("total", format_size_long(sum(s.bytes_before.values())),
                   format_size_long(sum(s.bytes_after.values())))
    if priced:
        totals.add_row("cost/month", format_cost(s.cost_before or 0.0), format_cost(s.cost_after or 0.0))
    out = render_text(totals, width).splitlines()
    if priced and s.unpriced_classes:
        out.extend(_wrapped(f"(cost leaves out {', '.join(s.unpriced_classes)}: no price configured)", width))
    out.append("")
    tiered = f"{format_size_long(s.bytes_transitioned)} in {_count(s.objects_transitioned, 'object')}"
    deleted = f"{format_size_long(s.bytes_deleted)} in {_count(s.objects_deleted, 'object')}"
    counts = (
        f"{_count(s.checkpoints, 'checkpoint')}: keep {s.kept}, "
        f"tier {s.transitioned} ({tiered}), delete {s.deleted} ({deleted})"
    )
    out.extend(_wrapped(counts, width))
    if s.unmanaged_objects:
        out.extend(
            _wrapped(
                f"not part of any checkpoint (left alone): {_count(s.unmanaged_objects, 'object')}, "
                f"{format_size_long(s.unmanaged_bytes)}",
                width,
            )
        )
    for warning in plan.warnings:
        out.extend(_wrapped(f"warning: {warning}", width))
    return out


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _wrapped(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width=max(width, 10), subsequent_indent="  ", break_on_hyphens=False) or [""]
