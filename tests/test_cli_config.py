"""Config errors: one clear line naming the key, a non-zero exit, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvrouter.router.config import ConfigError, load_config, parse_config, with_overrides


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvrouter.cli", *args],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    "yaml_text, expected",
    [
        ("replicas: [http://a:1]\nserver: {bogus: 1}\n", "server.bogus: unknown key"),
        ("replicas: [http://a:1]\nserver: {port: abc}\n", "server.port:"),
        ("replicas: [http://a:1, 'ftp://b']\n", "replicas.1: invalid replica URL"),
        ("replicas: [http://a:1]\npolicy: {name: nope}\n", "policy.name: unknown policy 'nope'"),
        ("replicas: [\n", "invalid YAML"),
        ("- just a list\n", "top level must be a mapping"),
    ],
)
def test_check_config_errors_are_one_line(tmp_path: Path, yaml_text: str, expected: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    result = run_cli("check-config", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_serve_rejects_bad_flag_url_before_serving() -> None:
    result = run_cli("serve", "--replica", "not-a-url")
    assert result.returncode == 2
    assert "replicas.0: invalid replica URL" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_check_config_ok(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("replicas: [http://127.0.0.1:30000/]\npolicy: {name: random}\n")
    result = run_cli("check-config", str(path))
    assert result.returncode == 0, result.stderr
    config = load_config(path)
    assert config.replicas == ("http://127.0.0.1:30000",)


def test_flags_override_file() -> None:
    base = parse_config({"replicas": ["http://a:1"], "server": {"port": 9000}})
    merged = with_overrides(base, port=9100, replicas=["http://b:2"], policy="random",
                            host=None)
    assert merged.server.port == 9100 and merged.replicas == ("http://b:2",)
    assert merged.policy.name == "random"
    with pytest.raises(ConfigError, match="server.port"):
        with_overrides(base, port=70000)
