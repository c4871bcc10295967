"""SETTINGS.md is what the settings classes say, and every public setting is described."""

from __future__ import annotations

from infra.settings_table import SECTIONS, TABLE, public_fields, render


def test_settings_md_is_generated_from_the_settings_classes() -> None:
    assert TABLE.read_text() == render(), "SETTINGS.md is stale: run `python -m infra.settings_table`"


def test_every_public_setting_has_a_description_and_internal_tuning_is_left_out() -> None:
    for _, model in SECTIONS:
        for name, field in public_fields(model):
            assert field.description, f"{model.__name__}.{name}"
            assert name != "tuning_overrides"
