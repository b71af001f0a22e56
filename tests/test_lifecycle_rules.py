"""Config parsing and validation for the [lifecycle] table."""

from __future__ import annotations

import pytest

from ckptfs.lifecycle.rules import (
    LifecycleConfigError,
    LifecycleRules,
    Tier,
    load_rules,
    parse_rules,
    rules_from_table,
    validate_rules,
)

SPEC_EXAMPLE = """
[lifecycle]
checkpoints = ["step_{step}", "ckpt-{step}.pt"]
markers = [".metadata", "commit_success.txt"]
keep_latest = 3
keep_every_steps = 10000
keep_geometric = 2
expire_after_days = 14
incomplete_grace_hours = 24
[[lifecycle.tiers]]
after_days = 7
storage_class = "GLACIER_IR"
[lifecycle.prices]
STANDARD = 0.023
GLACIER_IR = 0.004
"""


def test_spec_example_parses():
    rules = parse_rules(SPEC_EXAMPLE)
    assert rules.checkpoints == ("step_{step}", "ckpt-{step}.pt")
    assert rules.markers == (".metadata", "commit_success.txt")
    assert rules.keep_latest == 3
    assert rules.keep_every_steps == 10000
    assert rules.keep_geometric == 2
    assert rules.expire_after_days == 14
    assert rules.incomplete_grace_hours == 24
    assert rules.tiers == (Tier(after_days=7, storage_class="GLACIER_IR"),)
    assert dict(rules.prices) == {"STANDARD": 0.023, "GLACIER_IR": 0.004}
    assert rules.min_transition_bytes == 128 * 1024


def test_load_rules_reads_file(tmp_path):
    path = tmp_path / "ckptfs.toml"
    path.write_text('[gateway]\ncache = "/nvme"\n' + SPEC_EXAMPLE)
    assert load_rules(path).keep_latest == 3


def test_everything_is_optional():
    assert parse_rules("") == LifecycleRules()
    assert parse_rules("[lifecycle]\n") == LifecycleRules()
    rules = LifecycleRules()
    assert rules.keep_latest is None and rules.keep_geometric is None and rules.expire_after_days is None
    assert rules.incomplete_grace_hours is None and rules.tiers == ()


@pytest.mark.parametrize(
    "toml, message",
    [
        ('keep_latest = "three"', 'lifecycle.keep_latest: must be an integer >= 0, got "three"'),
        ("keep_latest = -1", "lifecycle.keep_latest: must be an integer >= 0, got -1"),
        ("keep_latest = true", "lifecycle.keep_latest: must be an integer >= 0, got true"),
        ("keep_latest = 2.5", "lifecycle.keep_latest: must be an integer >= 0, got 2.5"),
        ("keep_every_steps = 0", "lifecycle.keep_every_steps: must be an integer >= 1, got 0"),
        ("keep_geometric = 1", "lifecycle.keep_geometric: must be a number > 1, got 1"),
        ('keep_geometric = "2"', 'lifecycle.keep_geometric: must be a number > 1, got "2"'),
        ("expire_after_days = -3", "lifecycle.expire_after_days: must be a number >= 0, got -3"),
        ("expire_after_days = nan", "lifecycle.expire_after_days: must be a number >= 0"),
        ("incomplete_grace_hours = []", "lifecycle.incomplete_grace_hours: must be a number >= 0, got []"),
        ('checkpoints = "step_{step}"', 'lifecycle.checkpoints: must be a list of strings, got "step_{step}"'),
        ('checkpoints = ["step"]', "lifecycle.checkpoints[0]: must contain {step} exactly once"),
        ('checkpoints = ["a/step_{step}"]', "lifecycle.checkpoints[0]: must be a single file or directory name"),
        ('checkpoints = ["{epoch}_{step}"]', "lifecycle.checkpoints[0]: only the {step} placeholder"),
        ("checkpoints = [1]", "lifecycle.checkpoints[0]: must be a non-empty string"),
        ('markers = ["a/.done"]', "lifecycle.markers[0]: must be a file name"),
        ('markers = [""]', "lifecycle.markers[0]: must be a non-empty string"),
        ("min_transition_bytes = -1", "lifecycle.min_transition_bytes: must be an integer >= 0, got -1"),
        ("prices = 3", "lifecycle.prices: must be a table"),
        ("prices = { STANDARD = -1 }", "lifecycle.prices.STANDARD: must be a number >= 0"),
        ("tiers = 7", "lifecycle.tiers: must be an array of tables"),
    ],
)
def test_bad_values_are_refused_naming_the_setting(toml, message):
    with pytest.raises(LifecycleConfigError) as info:
        parse_rules("[lifecycle]\n" + toml + "\n")
    assert str(info.value).startswith(message)
    assert isinstance(info.value, ValueError)


def test_unknown_keys_are_refused_naming_them():
    with pytest.raises(LifecycleConfigError) as info:
        parse_rules("[lifecycle]\nkeep_lastest = 3\nfrobnicate = 1\n")
    message = str(info.value)
    assert message.startswith("lifecycle: unknown keys")
    assert '"keep_lastest" (did you mean "keep_latest"?)' in message
    assert '"frobnicate"' in message


def test_unknown_tier_key_is_refused():
    with pytest.raises(LifecycleConfigError, match=r'lifecycle\.tiers\[0\]: unknown key "class"'):
        parse_rules('[lifecycle]\n[[lifecycle.tiers]]\nafter_days = 7\nclass = "GLACIER_IR"\n')


def test_tier_missing_key_is_refused():
    with pytest.raises(LifecycleConfigError, match=r"lifecycle\.tiers\[0\]\.storage_class: missing"):
        parse_rules("[lifecycle]\n[[lifecycle.tiers]]\nafter_days = 7\n")


def test_tiers_must_increase():
    toml = """
[lifecycle]
[[lifecycle.tiers]]
after_days = 30
storage_class = "GLACIER_IR"
[[lifecycle.tiers]]
after_days = 30
storage_class = "DEEP_ARCHIVE"
"""
    with pytest.raises(LifecycleConfigError, match=r"lifecycle\.tiers\[1\]\.after_days: tiers must be in increasing"):
        parse_rules(toml)


def test_tier_classes_must_be_distinct():
    with pytest.raises(LifecycleConfigError, match=r"lifecycle\.tiers\[1\]\.storage_class: GLACIER_IR is already"):
        LifecycleRules(tiers=(Tier(1, "GLACIER_IR"), Tier(2, "GLACIER_IR")))


def test_tier_class_name_is_checked():
    with pytest.raises(LifecycleConfigError, match=r"lifecycle\.tiers\[0\]\.storage_class: must be a storage class"):
        LifecycleRules(tiers=(Tier(1, "has space"),))
    with pytest.raises(LifecycleConfigError, match=r"lifecycle\.tiers\[0\]\.after_days: must be a number >= 0"):
        LifecycleRules(tiers=(Tier(-1, "GLACIER_IR"),))


def test_custom_storage_classes_are_allowed():
    rules = rules_from_table({"tiers": [{"after_days": 3, "storage_class": "COLD_HDD"}], "prices": {"COLD_HDD": 0.01}})
    assert rules.tiers[0].storage_class == "COLD_HDD"
    assert not [w for w in validate_rules(rules) if "tiers" in w]


def test_direct_construction_is_validated_too():
    with pytest.raises(LifecycleConfigError, match="lifecycle.keep_latest"):
        LifecycleRules(keep_latest="three")  # type: ignore[arg-type]
    assert LifecycleRules(checkpoints=["step_{step}"]).checkpoints == ("step_{step}",)  # type: ignore[arg-type]


def test_invalid_toml_is_a_config_error():
    with pytest.raises(LifecycleConfigError, match="invalid TOML"):
        parse_rules("[lifecycle\n")
    with pytest.raises(LifecycleConfigError, match="lifecycle: must be a table"):
        parse_rules("lifecycle = 3\n")


# --------------------------------------------------------------------------- warnings

BASE = {"checkpoints": ["step_{step}"], "markers": [".metadata"]}


def warnings_for(**table):
    return validate_rules(rules_from_table({**BASE, **table}))


def test_sane_config_has_no_warnings():
    assert warnings_for(expire_after_days=200, tiers=[{"after_days": 30, "storage_class": "GLACIER_IR"}]) == []


def test_warns_when_ia_transition_is_younger_than_aws_allows():
    (warning,) = warnings_for(tiers=[{"after_days": 7, "storage_class": "STANDARD_IA"}])
    assert warning.startswith("lifecycle.tiers[0].after_days: 7 days is below the 30-day minimum")


def test_warns_when_expiry_precedes_tier_minimum_duration():
    (warning,) = warnings_for(expire_after_days=14, tiers=[{"after_days": 7, "storage_class": "GLACIER_IR"}])
    assert warning.startswith("lifecycle.expire_after_days:")
    assert "GLACIER_IR" in warning and "90-day minimum" in warning and "early-deletion" in warning


def test_expiry_warning_uses_the_last_tier_reached():
    tiers = [
        {"after_days": 1, "storage_class": "INTELLIGENT_TIERING"},
        {"after_days": 30, "storage_class": "DEEP_ARCHIVE"},
    ]
    warnings = warnings_for(expire_after_days=100, tiers=tiers)
    assert len(warnings) == 2  # archive note + 70 days in DEEP_ARCHIVE < 180
    assert any("DEEP_ARCHIVE" in w and "180-day minimum" in w for w in warnings)
    assert any("must be restored" in w for w in warnings)


def test_warns_when_next_tier_comes_before_class_minimum():
    tiers = [{"after_days": 30, "storage_class": "GLACIER_IR"}, {"after_days": 60, "storage_class": "DEEP_ARCHIVE"}]
    warnings = warnings_for(tiers=tiers)
    assert any(w.startswith("lifecycle.tiers[0]: objects move on to DEEP_ARCHIVE after 30 days") for w in warnings)


def test_expiry_after_tier_minimum_does_not_warn():
    assert warnings_for(expire_after_days=100, tiers=[{"after_days": 7, "storage_class": "GLACIER_IR"}]) == []


def test_warns_about_lowercase_class_and_missing_markers_and_prices():
    warnings = validate_rules(
        rules_from_table(
            {
                "checkpoints": ["step_{step}"],
                "tiers": [{"after_days": 1, "storage_class": "glacier_ir"}],
                "prices": {"STANDARD": 0.02},
            }
        )
    )
    assert any(w.startswith("lifecycle.markers: not set") for w in warnings)
    assert any("did you mean 'GLACIER_IR'" in w for w in warnings)
    assert any(w.startswith("lifecycle.prices: no price for glacier_ir") for w in warnings)


def test_warns_when_nothing_is_managed():
    assert validate_rules(LifecycleRules())[0].startswith("lifecycle.checkpoints: not set")
