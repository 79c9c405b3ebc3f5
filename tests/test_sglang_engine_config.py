"""deploy/sglang: every key and value of the reference engine config (and every flag of its launch
script) checked against SGLang's own argument definitions at a pinned release, read from the
released wheel's source with `ast` -- no GPU, no torch, no import of sglang."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import orjson
import pytest
import yaml

from kvrouter.router.config import RouterConfig

from .sglang_args import Wheel, check_config, pydantic_fields, sglang_arguments

SGLANG_VERSION = "0.5.23"  # keep equal to the version named in deploy/sglang/kimi-k2.6-b200-tp4.yaml
ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "deploy" / "sglang" / "kimi-k2.6-b200-tp4.yaml"
LAUNCH = ROOT / "deploy" / "sglang" / "launch.sh"


@pytest.fixture(scope="session")
def sglang_wheel(tmp_path_factory) -> str:
    """sglang==SGLANG_VERSION from the package registry, downloaded once per test session."""
    dest = tmp_path_factory.mktemp("sglang-wheel")
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--dest", str(dest), f"sglang=={SGLANG_VERSION}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"cannot download sglang=={SGLANG_VERSION} from the package registry: {err}")
    wheels = list(dest.glob("sglang-*.whl"))
    if done.returncode != 0 or not wheels:
        pytest.skip(f"cannot download sglang=={SGLANG_VERSION} from the package registry "
                    f"(pip exit {done.returncode}): {done.stderr.strip()[-300:]}")
    return str(wheels[0])


@pytest.fixture(scope="session")
def sglang_args(sglang_wheel):
    return sglang_arguments(sglang_wheel)


def engine_config() -> dict:
    data = yaml.safe_load(ENGINE.read_text())
    assert isinstance(data, dict)
    return data


def test_engine_config_names_the_pinned_release():
    assert f"sglang=={SGLANG_VERSION}" in ENGINE.read_text()


def test_every_key_and_value_is_a_valid_sglang_argument(sglang_args):
    assert len(sglang_args) > 300, "suspiciously few arguments read: the source layout changed?"
    config = engine_config()
    assert check_config(config, sglang_args) == []
    # The choices the issue asks for, present and spelled as SGLang spells them.
    assert config["model-path"] == "nvidia/Kimi-K2.6-NVFP4"
    assert config["quantization"] == "modelopt_fp4" and config["tp-size"] == 4
    assert config["kv-cache-dtype"] == "fp8_e4m3"
    assert config["speculative-algorithm"] == "DFLASH"
    assert config["enable-hierarchical-cache"] is True and config["hicache-ratio"] == 2
    assert config["hicache-write-policy"] and config["hicache-storage-backend"]
    assert config["enable-metrics"] is True and config["enable-cache-report"] is True
    assert config["tool-call-parser"] == config["reasoning-parser"] == "kimi_k2"


def test_the_checker_rejects_what_sglang_rejects(sglang_args):
    bad = {"tp": 4, "kv-cache-dtype": "fp9", "tp-size": True, "enable-metrics": 1,
           "hicache-ratio": "two", "tool-call-parser": "kimi_k9", "quantization": "nvfp4_typo"}
    problems = check_config(bad, sglang_args)
    assert len(problems) == len(bad), problems


def test_dflash_is_a_builtin_speculative_algorithm(sglang_wheel):
    wheel = Wheel(zipfile.ZipFile(sglang_wheel))
    tree = wheel.module("sglang.srt.speculative.spec_info")
    algos = {t.id for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "SpeculativeAlgorithm"
             for s in node.body if isinstance(s, ast.Assign) for t in s.targets if isinstance(t, ast.Name)}
    assert engine_config()["speculative-algorithm"] in algos


def test_launch_script_flags_and_kv_events_config(sglang_args, sglang_wheel):
    text = LAUNCH.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    flags = set(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]+)", code))
    assert {"config", "speculative-draft-model-path", "kv-events-config"} <= flags
    unknown = [f for f in flags if f.replace("-", "_") not in sglang_args]
    assert unknown == []
    # The KV-events JSON the script builds uses KVEventsConfig's own field names and kvrouter's ports.
    kv_json = re.search(r'"(\{\\"publisher.*?\})"', text).group(1)
    kv_json = kv_json.replace('\\"', '"').replace("${kv_port}", "5557").replace("${replay_port}", "5558")
    kv = orjson.loads(kv_json)
    assert set(kv) <= pydantic_fields(sglang_wheel, "sglang.srt.disaggregation.kv_events", "KVEventsConfig")
    router_kv = RouterConfig().kv_events
    assert kv["endpoint"].endswith(f":{router_kv.port}") and kv["topic"] == router_kv.topic
    assert subprocess.run(["bash", "-n", str(LAUNCH)]).returncode == 0


def test_engine_config_matches_kvrouter_and_the_simulator_profile():
    config = engine_config()
    text = ENGINE.read_text()
    assert config["page-size"] == RouterConfig().kv_events.page_size  # exact index block size
    profiles = ROOT / "loadtest" / "profiles"
    named = set(re.findall(r"kimi-k2\.6-b200-tp[48][\w.-]*", text))
    assert "kimi-k2.6-b200-tp4-fp8kv-hicache" in named
    for name in named:
        assert (profiles / f"{name}.yaml").exists(), name
    profile = yaml.safe_load((profiles / "kimi-k2.6-b200-tp4-fp8kv-hicache.yaml").read_text())
    base = yaml.safe_load((profiles / "kimi-k2.6-b200-tp4-fp8kv.yaml").read_text())
    assert base["kv_bytes_per_token"] == 35136  # FP8 KV, as configured
    assert profile["host_total_num_tokens"] == config["hicache-ratio"] * base["max_total_num_tokens"]


def test_k8s_configmap_embeds_the_same_engine_config():
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "sglang.yaml").read_text()))
    cm = next(d for d in docs if d and d["kind"] == "ConfigMap")
    assert cm["data"]["engine.yaml"] == ENGINE.read_text()
    assert cm["data"]["launch.sh"] == LAUNCH.read_text()


VARIANTS = {
    name: ROOT / "deploy" / "sglang" / f"{name}.yaml"
    for name in ("kimi-k2.6-b200-tp4-pd-prefill", "kimi-k2.6-b200-tp4-pd-decode", "kimi-k2.6-b200-tp4-dp4")
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_configs_are_valid_sglang_arguments(sglang_args, name):
    path = VARIANTS[name]
    assert f"sglang=={SGLANG_VERSION}" in path.read_text()
    config = yaml.safe_load(path.read_text())
    assert check_config(config, sglang_args) == []
    # what they share with the colocated config, key for key
    base = engine_config()
    for key in ("model-path", "quantization", "tp-size", "kv-cache-dtype", "page-size",
                "mem-fraction-static", "chunked-prefill-size", "enable-metrics", "enable-cache-report"):
        assert config[key] == base[key], key


def test_pd_variants_pair_up_as_kvrouter_expects():
    prefill = yaml.safe_load(VARIANTS["kimi-k2.6-b200-tp4-pd-prefill"].read_text())
    decode = yaml.safe_load(VARIANTS["kimi-k2.6-b200-tp4-pd-decode"].read_text())
    assert (prefill["disaggregation-mode"], decode["disaggregation-mode"]) == ("prefill", "decode")
    assert prefill["disaggregation-transfer-backend"] == decode["disaggregation-transfer-backend"]
    # kvrouter's --prefill URL without =PORT means SGLang's default, which the prefill config states
    from kvrouter.router.config import SGLANG_BOOTSTRAP_PORT
    assert prefill["disaggregation-bootstrap-port"] == SGLANG_BOOTSTRAP_PORT
    assert prefill["speculative-algorithm"] == decode["speculative-algorithm"]  # both halves alike
    assert prefill["enable-hierarchical-cache"] is True  # the prefix cache lives on the prefill side
    assert not any(k.startswith("hicache") or k == "enable-hierarchical-cache" for k in decode)


def test_dp_variant_matches_its_per_rank_profile():
    from kvrouter.loadtest.derivation import kv_budget_gib
    from kvrouter.loadtest.profiles import load_profile

    config = yaml.safe_load(VARIANTS["kimi-k2.6-b200-tp4-dp4"].read_text())
    assert config["tp-size"] == config["attn-dp-size"] == 4 and "dp-size" not in config
    assert "speculative-algorithm" not in config  # DFLASH does not run with DP attention
    profile = load_profile("kimi-k2.6-b200-tp4-dp4-fp8kv")  # its derivation is checked at load
    assert profile.max_total_num_tokens == 618944 and round(kv_budget_gib(profile), 2) == 20.25
    assert profile.max_running_requests * config["attn-dp-size"] == config["max-running-requests"]
    assert profile.mem_fraction_static == config["mem-fraction-static"]
