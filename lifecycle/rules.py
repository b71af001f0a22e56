"""The ``[lifecycle]`` config table: parsing, validation and warnings.

Every setting is optional and an absent setting means the rule does not apply.
Errors raise :class:`LifecycleConfigError` whose message starts with the
dotted name of the offending setting (``lifecycle.keep_latest: ...``) so the
CLI can print it as-is.  Things that are legal but probably costly or surprising
(early-deletion charges, AWS transition minimums) are returned as warnings by
:func:`validate_rules` instead.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from os import PathLike
from types import MappingProxyType
from typing import Any

from .patterns import PatternError, check_marker_glob, compile_step_pattern
from .storage_classes import (
    ARCHIVE_CLASSES,
    DEFAULT_MIN_TRANSITION_BYTES,
    KNOWN_CLASSES,
    MIN_TRANSITION_AGE_DAYS,
    STANDARD,
    min_storage_days,
)

TABLE = "lifecycle"

_STORAGE_CLASS_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class LifecycleConfigError(ValueError):
    """A lifecycle setting is invalid; the message names the setting."""


@dataclass(frozen=True)
class Tier:
    """Move checkpoints older than ``after_days`` to ``storage_class``."""

    after_days: float
    storage_class: str


@dataclass(frozen=True)
class LifecycleRules:
    """Validated lifecycle settings.  ``None`` / empty means "rule absent".

    Constructing one directly validates it exactly like the TOML path does.
    """

    checkpoints: tuple[str, ...] = ()
    markers: tuple[str, ...] = ()
    keep_latest: int | None = None
    keep_every_steps: int | None = None
    keep_geometric: float | None = None
    expire_after_days: float | None = None
    incomplete_grace_hours: float | None = None
    tiers: tuple[Tier, ...] = ()
    prices: Mapping[str, float] = field(default_factory=dict)
    min_transition_bytes: int = DEFAULT_MIN_TRANSITION_BYTES

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "checkpoints", _check_checkpoint_patterns(self.checkpoints))
        set_(self, "markers", _check_markers(self.markers))
        set_(self, "keep_latest", _optional_int(self.keep_latest, "keep_latest", minimum=0))
        set_(self, "keep_every_steps", _optional_int(self.keep_every_steps, "keep_every_steps", minimum=1))
        if self.keep_geometric is not None:
            ratio = self.keep_geometric
            if not _is_number(ratio) or not ratio > 1:
                raise _error("keep_geometric", "must be a number > 1", ratio)
        for name in ("expire_after_days", "incomplete_grace_hours"):
            value = getattr(self, name)
            if value is not None and (not _is_number(value) or value < 0):
                raise _error(name, "must be a number >= 0", value)
        set_(self, "tiers", _check_tiers(self.tiers))
        set_(self, "prices", _check_prices(self.prices))
        min_bytes = _optional_int(self.min_transition_bytes, "min_transition_bytes", minimum=0)
        if min_bytes is None:
            raise _error("min_transition_bytes", "must be an integer >= 0", None)
        set_(self, "min_transition_bytes", min_bytes)


SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(LifecycleRules))
TIER_SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(Tier))


# --------------------------------------------------------------------------- parsing


def load_rules(path: str | PathLike[str]) -> LifecycleRules:
    """Read a TOML file and return its ``[lifecycle]`` table as rules."""
    with open(path, "rb") as f:
        try:
            document = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise LifecycleConfigError(f"{path}: invalid TOML: {exc}") from exc
    return rules_from_document(document)


def parse_rules(text: str) -> LifecycleRules:
    """Parse TOML text and return its ``[lifecycle]`` table as rules."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise LifecycleConfigError(f"invalid TOML: {exc}") from exc
    return rules_from_document(document)


def rules_from_document(document: Mapping[str, Any]) -> LifecycleRules:
    """Rules from a whole parsed TOML document; no ``[lifecycle]`` = no rules."""
    table = document.get(TABLE, {})
    if not isinstance(table, Mapping):
        raise LifecycleConfigError(f"{TABLE}: must be a table, got {_show(table)}")
    return rules_from_table(table)


def rules_from_table(table: Mapping[str, Any]) -> LifecycleRules:
    """Rules from the contents of the ``[lifecycle]`` table."""
    _refuse_unknown_keys(table, SETTINGS, TABLE)
    # Type and range checks live in LifecycleRules.__post_init__ so that rules
    # built in code are held to the same standard as rules read from TOML.
    return LifecycleRules(**table)


# --------------------------------------------------------------------------- warnings


def validate_rules(rules: LifecycleRules) -> list[str]:
    """Warnings about legal but costly or surprising settings (errors raise earlier)."""
    warnings: list[str] = []
    if not rules.checkpoints:
        warnings.append(f"{TABLE}.checkpoints: not set; no checkpoint is recognised, so nothing is managed")
    elif not rules.markers:
        warnings.append(
            f"{TABLE}.markers: not set; a directory checkpoint can never be proven complete, "
            "so directory checkpoints are never deleted or tiered (single-file checkpoints are unaffected)"
        )
    for index, tier in enumerate(rules.tiers):
        where = f"{TABLE}.tiers[{index}]"
        cls = tier.storage_class
        if cls not in KNOWN_CLASSES and cls.upper() in KNOWN_CLASSES:
            warnings.append(
                f"{where}.storage_class: {cls!r} is not an S3 class name (they are case-sensitive); "
                f"did you mean {cls.upper()!r}?"
            )
        if cls == STANDARD:
            warnings.append(f"{where}.storage_class: tiering to STANDARD does nothing for objects already in STANDARD")
        min_age = MIN_TRANSITION_AGE_DAYS.get(cls)
        if min_age is not None and tier.after_days < min_age:
            warnings.append(
                f"{where}.after_days: {_days(tier.after_days)} is below the {min_age}-day minimum object age "
                f"AWS requires before a transition to {cls}; S3 lifecycle rules would refuse it"
            )
        if cls in ARCHIVE_CLASSES:
            warnings.append(
                f"{where}.storage_class: {cls} objects must be restored (hours) before a checkpoint "
                "can be read, and are not tiered further by ckptfs"
            )
        minimum = min_storage_days(cls)
        if not minimum:
            continue
        # How long an object stays in this class before the next rule moves or
        # deletes it; shorter than the class minimum is billed as the minimum.
        if index + 1 < len(rules.tiers):
            nxt = rules.tiers[index + 1]
            stay = nxt.after_days - tier.after_days
            if stay < minimum:
                warnings.append(
                    f"{where}: objects move on to {nxt.storage_class} after {_days(stay)} in {cls}, "
                    f"below its {minimum}-day minimum storage duration (early-deletion charge)"
                )
        if rules.expire_after_days is not None and tier.after_days < rules.expire_after_days:
            next_after = rules.tiers[index + 1].after_days if index + 1 < len(rules.tiers) else math.inf
            if rules.expire_after_days <= next_after:
                stay = rules.expire_after_days - tier.after_days
                if stay < minimum:
                    warnings.append(
                        f"{TABLE}.expire_after_days: {_days(rules.expire_after_days)} deletes checkpoints "
                        f"{_days(stay)} after they move to {cls} ({where}), below its {minimum}-day minimum "
                        "storage duration (early-deletion charge)"
                    )
    if rules.prices:
        used = {STANDARD} | {t.storage_class for t in rules.tiers}
        missing = sorted(used - set(rules.prices))
        if missing:
            warnings.append(f"{TABLE}.prices: no price for {', '.join(missing)}; cost totals leave them out")
    return warnings


# --------------------------------------------------------------------------- helpers


def _error(name: str, expectation: str, value: object) -> LifecycleConfigError:
    return LifecycleConfigError(f"{TABLE}.{name}: {expectation}, got {_show(value)}")


def _show(value: object) -> str:
    """Render a value the way it looks in TOML (strings quoted, true/false)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _is_number(value: object) -> bool:
    # bool is an int subclass; `keep_latest = true` is a mistake, not 1.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _optional_int(value: object, name: str, *, minimum: int) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _error(name, f"must be an integer >= {minimum}", value)
    return value


def _string_list(values: object, name: str) -> tuple[str, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise _error(name, "must be a list of strings", values)
    return tuple(values)


def _check_checkpoint_patterns(values: object) -> tuple[str, ...]:
    patterns = _string_list(values, "checkpoints")
    for index, text in enumerate(patterns):
        try:
            compile_step_pattern(text)
        except PatternError as exc:
            raise LifecycleConfigError(f"{TABLE}.checkpoints[{index}]: {exc}") from None
    if len(set(patterns)) != len(patterns):
        raise _error("checkpoints", "must not repeat a pattern", list(patterns))
    return patterns


def _check_markers(values: object) -> tuple[str, ...]:
    markers = _string_list(values, "markers")
    for index, text in enumerate(markers):
        try:
            check_marker_glob(text)
        except PatternError as exc:
            raise LifecycleConfigError(f"{TABLE}.markers[{index}]: {exc}") from None
    return markers


def _check_tiers(values: object) -> tuple[Tier, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise _error("tiers", "must be an array of tables ([[lifecycle.tiers]])", values)
    tiers: list[Tier] = []
    for index, tier in enumerate(values):
        where = f"{TABLE}.tiers[{index}]"
        if isinstance(tier, Mapping):
            _refuse_unknown_keys(tier, TIER_SETTINGS, where)
            for required in TIER_SETTINGS:
                if required not in tier:
                    raise LifecycleConfigError(f"{where}.{required}: missing")
            tier = Tier(after_days=tier["after_days"], storage_class=tier["storage_class"])
        if not isinstance(tier, Tier):
            raise LifecycleConfigError(f"{where}: must be a table, got {_show(tier)}")
        if not _is_number(tier.after_days) or tier.after_days < 0:
            raise LifecycleConfigError(f"{where}.after_days: must be a number >= 0, got {_show(tier.after_days)}")
        cls = tier.storage_class
        if not isinstance(cls, str) or not _STORAGE_CLASS_RE.match(cls):
            raise LifecycleConfigError(
                f"{where}.storage_class: must be a storage class name "
                f"(letters, digits, '_', '-', '.'), got {_show(cls)}"
            )
        if tiers and tier.after_days <= tiers[-1].after_days:
            raise LifecycleConfigError(
                f"{where}.after_days: tiers must be in increasing after_days order, "
                f"got {_show(tier.after_days)} after {_show(tiers[-1].after_days)}"
            )
        for earlier_index, earlier in enumerate(tiers):
            if earlier.storage_class == cls:
                raise LifecycleConfigError(
                    f"{where}.storage_class: {cls} is already used by {TABLE}.tiers[{earlier_index}]"
                )
        tiers.append(tier)
    return tuple(tiers)


def _check_prices(values: object) -> Mapping[str, float]:
    if not isinstance(values, Mapping):
        raise _error("prices", "must be a table of storage class = $ per GB-month", values)
    for cls, price in values.items():
        if not isinstance(cls, str) or not _STORAGE_CLASS_RE.match(cls):
            raise LifecycleConfigError(f"{TABLE}.prices: invalid storage class name {_show(cls)}")
        if not _is_number(price) or price < 0:
            raise LifecycleConfigError(
                f"{TABLE}.prices.{cls}: must be a number >= 0 ($ per GB-month), got {_show(price)}"
            )
    return MappingProxyType(dict(values))


def _refuse_unknown_keys(table: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    unknown = [key for key in table if key not in known]
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), known, n=1)
        hints.append(f"{_show(key)} (did you mean {_show(close[0])}?)" if close else _show(key))
    noun = "key" if len(unknown) == 1 else "keys"
    raise LifecycleConfigError(f"{where}: unknown {noun} {', '.join(hints)}; known: {', '.join(known)}")


def _days(value: float) -> str:
    return f"{value:g} days" if value != 1 else "1 day"
