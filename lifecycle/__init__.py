"""Checkpoint-aware retention and tiering for the ckptfs bucket.

``plan()`` (pure) turns a bucket listing plus rules into a ``Plan``.
Not imported here, because they need the object store and trio:
``ckptfs.lifecycle.executor`` carries a plan out (deletes, tags + bucket lifecycle
rules, or copies in place), ``ckptfs.lifecycle.pins`` keeps pins in the bucket, and
``ckptfs.cli.lifecycle`` is ``ckptfs lifecycle plan|apply`` and ``ckptfs promote``.
"""

if __name__ != "ckptfs.lifecycle":  # e.g. a source tree on sys.path: one module under two names breaks state
    raise ImportError("ckptfs's lifecycle package is ckptfs.lifecycle; import that instead of lifecycle")

from .catalog import MTIME_TAG, Catalog, Checkpoint, ListedObject, Series, build_catalog
from .planner import (
    DELETE,
    KEEP,
    TRANSITION,
    CheckpointPlan,
    Plan,
    PlanSummary,
    apply_plan,
    plan,
)
from .render import plan_to_json, render_table, summary_to_json
from .rules import (
    LifecycleConfigError,
    LifecycleRules,
    Tier,
    load_rules,
    parse_rules,
    rules_from_document,
    rules_from_table,
    validate_rules,
)

__all__ = [
    "DELETE",
    "KEEP",
    "MTIME_TAG",
    "TRANSITION",
    "Catalog",
    "Checkpoint",
    "CheckpointPlan",
    "LifecycleConfigError",
    "LifecycleRules",
    "ListedObject",
    "Plan",
    "PlanSummary",
    "Series",
    "Tier",
    "apply_plan",
    "build_catalog",
    "load_rules",
    "parse_rules",
    "plan",
    "plan_to_json",
    "render_table",
    "rules_from_document",
    "rules_from_table",
    "summary_to_json",
    "validate_rules",
]
