"""What the lifecycle code knows about S3 storage classes.

Only facts that change decisions or warnings live here.  Class names we do not
know (radosgw placement targets, MinIO tiers, ...) are allowed everywhere; they
simply have no minimum duration and no known position in the cold/warm order.
"""

from __future__ import annotations

STANDARD = "STANDARD"

# Minimum billable storage duration in days.  Deleting (or transitioning away)
# earlier is billed as if the object had stayed the full period.
MIN_STORAGE_DAYS: dict[str, int] = {
    "STANDARD": 0,
    "REDUCED_REDUNDANCY": 0,
    "EXPRESS_ONEZONE": 0,
    "INTELLIGENT_TIERING": 0,
    "STANDARD_IA": 30,
    "ONEZONE_IA": 30,
    "GLACIER_IR": 90,
    "GLACIER": 90,
    "DEEP_ARCHIVE": 180,
}

# AWS lifecycle refuses transitions to these classes for objects younger than
# this many days.
MIN_TRANSITION_AGE_DAYS: dict[str, int] = {
    "STANDARD_IA": 30,
    "ONEZONE_IA": 30,
}

# Warm-to-cold order of the AWS classes (the "waterfall").  Used only to avoid
# planning a move from a colder class to a warmer one, which is a restore, not
# a tiering step.
COLDNESS: dict[str, int] = {
    "STANDARD": 0,
    "REDUCED_REDUNDANCY": 0,
    "EXPRESS_ONEZONE": 0,
    "INTELLIGENT_TIERING": 1,
    "STANDARD_IA": 2,
    "ONEZONE_IA": 3,
    "GLACIER_IR": 4,
    "GLACIER": 5,
    "DEEP_ARCHIVE": 6,
}

# Objects in these classes cannot be read or copied without a restore request
# (hours), so the planner never schedules a transition *from* them.
ARCHIVE_CLASSES: frozenset[str] = frozenset({"GLACIER", "DEEP_ARCHIVE"})

# S3 lifecycle does not transition objects smaller than 128 KiB, and the IA /
# Glacier classes bill small objects as 128 KiB anyway, so moving them only
# costs request fees.
DEFAULT_MIN_TRANSITION_BYTES = 128 * 1024

# S3 bills storage per GB-month with GB = 2**30 bytes.
BYTES_PER_BILLED_GB = 1 << 30

KNOWN_CLASSES: frozenset[str] = frozenset(MIN_STORAGE_DAYS)


def min_storage_days(storage_class: str) -> int:
    return MIN_STORAGE_DAYS.get(storage_class, 0)


def normalize_storage_class(storage_class: str | None) -> str:
    """S3 omits StorageClass (or sends "") for STANDARD objects in some APIs."""
    return storage_class or STANDARD
