"""Settings: defaults, ORTSERVE_* env vars, config files, bounds, and the argparse flags built from them."""

from __future__ import annotations

import argparse
import json

import pytest
from pydantic import ValidationError

from server.settings import Settings, add_settings_arguments, load_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("ORTSERVE_") and name != "ORTSERVE_CACHE_DIR":
            monkeypatch.delenv(name)


def _parse(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return vars(parser.parse_args(argv))


def test_defaults_are_local_and_bounded() -> None:
    s = Settings()
    assert (s.host, s.port, s.model, s.provider) == ("127.0.0.1", 8000, "smollm2-135m-instruct", "auto")
    assert s.cors_origins == [] and s.api_key is None and s.int4_gemv is None
    assert s.max_body_bytes == 4 * 1024 * 1024


def test_env_vars_with_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTSERVE_MAX_BATCH", "16")
    monkeypatch.setenv("ORTSERVE_CORS_ORIGINS", "http://a.test, http://b.test")
    monkeypatch.setenv("ORTSERVE_EP_OPTION", "device_id=1,enable_x=0")
    monkeypatch.setenv("ORTSERVE_INT4_GEMV", "false")
    monkeypatch.setenv("ORTSERVE_API_KEY", "sekret")
    s = Settings()
    assert s.max_batch == 16
    assert s.cors_origins == ["http://a.test", "http://b.test"]
    assert s.ep_options() == {"device_id": "1", "enable_x": "0"}
    assert s.int4_gemv is False
    assert s.api_key_value() == "sekret" and "sekret" not in repr(s)


@pytest.mark.parametrize("field,value", [("port", 0), ("port", 70000), ("max_batch", 0), ("max_body_bytes", 10),
                                         ("shutdown_grace_s", -1.0), ("max_model_len", 1)])
def test_out_of_range_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as info:
        Settings(**{field: value})
    assert field in str(info.value)


def test_bad_ep_option_and_unknown_field() -> None:
    with pytest.raises(ValidationError, match="KEY=VALUE"):
        Settings(ep_option=["novalue"])
    with pytest.raises(ValidationError):
        Settings(no_such_setting=1)


def test_config_file_is_below_env_and_cli(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "ortserve.json"
    cfg.write_text(json.dumps({"max_batch": 4, "port": 9001, "max_queue": 7}))
    monkeypatch.setenv("ORTSERVE_PORT", "9002")
    s = load_settings({"max_queue": 9}, config_file=cfg)
    assert (s.max_batch, s.port, s.max_queue) == (4, 9002, 9)
    assert type(s) is Settings

    toml = tmp_path / "ortserve.toml"
    toml.write_text('model = "/models/x"\ncors_origins = ["http://c.test"]\n')
    s = load_settings({}, config_file=toml)
    assert s.model == "/models/x" and s.cors_origins == ["http://c.test"]


def test_config_file_values_are_validated(tmp_path) -> None:
    cfg = tmp_path / "bad.json"
    cfg.write_text(json.dumps({"max_batch": -3}))
    with pytest.raises(ValidationError, match="max_batch"):
        load_settings({}, config_file=cfg)


def test_flags_generated_from_fields() -> None:
    parsed = _parse(["--model", "/m", "--port", "9000", "--no-int4-gemv", "--ep-option", "a=1",
                     "--ep-option", "b=2", "--api-key", "k", "--log-level", "debug", "--shutdown-grace-s", "2.5"])
    s = Settings(**parsed)
    assert s.model == "/m" and s.port == 9000 and s.int4_gemv is False
    assert s.ep_options() == {"a": "1", "b": "2"}
    assert s.api_key_value() == "k" and s.log_level == "debug" and s.shutdown_grace_s == 2.5
    assert Settings(**_parse(["--int4-gemv"])).int4_gemv is True


def test_unset_flags_do_not_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTSERVE_MAX_QUEUE", "3")
    parsed = _parse(["--port", "8123"])
    assert "max_queue" not in parsed
    assert load_settings(parsed).max_queue == 3


def test_every_field_has_a_flag_and_a_description() -> None:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    options = {opt for action in parser._actions for opt in action.option_strings}
    for name, field in Settings.model_fields.items():
        assert "--" + name.replace("_", "-") in options, name
        assert field.description, name


@pytest.mark.parametrize(("argv", "expected"), [([], None), (["--graph-capture"], True),
                                                 (["--no-graph-capture"], False)])
def test_graph_capture_flag_reaches_the_engine_config(argv: list[str], expected: bool | None) -> None:
    from server.app import engine_config_from

    assert engine_config_from(Settings(**_parse(argv))).graph_capture is expected


@pytest.mark.parametrize(("argv", "caching", "speculative"), [
    ([], True, None), (["--no-prefix-caching"], False, None), (["--speculative-tokens", "0"], True, 0),
    (["--prefix-caching", "--speculative-tokens", "12"], True, 12)])
def test_prefix_caching_and_speculation_flags_reach_the_engine_config(argv: list[str], caching: bool,
                                                                     speculative: int | None) -> None:
    from engine.config import DEFAULT_SPECULATIVE_TOKENS
    from server.app import engine_config_from

    config = engine_config_from(Settings(**_parse(argv)))
    assert config.prefix_caching is caching
    assert config.speculative_tokens == (DEFAULT_SPECULATIVE_TOKENS if speculative is None else speculative)


def test_speculative_tokens_is_bounded() -> None:
    with pytest.raises(ValidationError, match="speculative_tokens"):
        Settings(speculative_tokens=65)
