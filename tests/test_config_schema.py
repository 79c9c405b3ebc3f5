"""The config reference and JSON Schema are generated from the pydantic models; the checked-in
docs/config-reference.md must equal the generated one, so it cannot drift."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from kvrouter.router import schema
from kvrouter.router.config import RouterConfig

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "config-reference.md"


def test_config_reference_is_up_to_date():
    assert REFERENCE.read_text() == schema.markdown(), (
        "docs/config-reference.md is stale: regenerate it with\n"
        "  python -m kvrouter.router.schema --markdown > docs/config-reference.md"
    )


def test_reference_documents_every_key():
    text = REFERENCE.read_text()
    for name, field in RouterConfig.model_fields.items():
        assert f"| `{name}` |" in text
    for key in ("`kubernetes`", "`port_name`", "`interval_s`", "`redis_url`"):
        assert key in text


def test_module_entry_point_prints_the_reference():
    done = subprocess.run([sys.executable, "-m", "kvrouter.router.schema", "--markdown"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout == REFERENCE.read_text()


def test_config_schema_command_prints_a_json_schema(capsys):
    assert schema.config_schema_command(argparse.Namespace(markdown=False)) == 0
    printed = json.loads(capsys.readouterr().out)
    jsonschema.Draft202012Validator.check_schema(printed)
    assert printed["additionalProperties"] is False and "discovery" in printed["properties"]


@pytest.mark.parametrize("path", ["deploy/k8s/router-config.yaml", "deploy/k8s/sidecar-example.yaml"])
def test_shipped_configs_validate_against_the_schema(path):
    validator = jsonschema.Draft202012Validator(schema.json_schema())
    for doc in yaml.safe_load_all((ROOT / path).read_text()):
        if doc and doc["kind"] == "ConfigMap":
            validator.validate(yaml.safe_load(doc["data"]["config.yaml"]))


def test_schema_rejects_what_the_router_rejects():
    validator = jsonschema.Draft202012Validator(schema.json_schema())
    for bad in ({"server": {"bogus": 1}}, {"server": {"port": 70000}},
                {"discovery": {"dns": {"port": 30000}}}, {"signals": {"source": "nope"}}):
        assert list(validator.iter_errors(bad)), bad
