"""SETTINGS.md is what the settings classes say, and every public setting is described."""

from __future__ import annotations

from pathlib import Path

from infra.images import kube
from infra.images.container_stack import local_settings
from infra.local.stack import StackConfig, service_env, standby_env
from infra.settings_table import SECTIONS, TABLE, public_fields, render
from services.ingest.settings import IngestSettings
from shared.settings import BaseServiceSettings


def test_settings_md_is_generated_from_the_settings_classes() -> None:
    assert TABLE.read_text() == render(), "SETTINGS.md is stale: run `python -m infra.settings_table`"


def test_every_public_setting_has_a_description_and_internal_tuning_is_left_out() -> None:
    for _, model in SECTIONS:
        for name, field in public_fields(model):
            assert field.description, f"{model.__name__}.{name}"
            assert name != "tuning_overrides"


def test_every_variable_the_stacks_set_is_a_setting_of_its_service(tmp_path: Path) -> None:
    """A service refuses to start on a variable with its prefix that names no setting: the local
    stack's, the standby's, the containers' and the Kubernetes ConfigMap's."""
    cfg = StackConfig(run_dir=tmp_path)
    configmap = kube.find(kube.load(), "ConfigMap", kube.CONFIGMAP)["data"]
    for env in (service_env(cfg), standby_env(cfg), local_settings(cfg), configmap):
        for _, model in SECTIONS:
            if issubclass(model, BaseServiceSettings):
                assert model.unknown_variables(env) == [], model.__name__


def test_a_misspelt_or_internal_variable_is_reported() -> None:
    env = {"SF_INGEST_HTTP_PROT": "1", "SF_INGEST_TUNING": "{}", "SF_INGEST_HTTP_PORT": "1", "SF_X": "1"}
    assert IngestSettings.unknown_variables(env) == ["SF_INGEST_HTTP_PROT"]
