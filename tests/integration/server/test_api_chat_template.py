"""A model without a chat template (a base model): chat requests get a 400 that points to /v1/completions and
to --chat-template; with --chat-template (a built-in name or a Jinja file) chat works."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from server.__main__ import main
from server.app import create_app

from conftest import api_settings, serve_app

MESSAGES = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def base_model(api_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic model with its chat template removed."""
    folder = tmp_path_factory.mktemp("base") / "model"
    shutil.copytree(api_model, folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))
    return folder


def test_chat_without_a_template_is_a_clear_400(base_model):
    with serve_app(create_app(api_settings(base_model))) as server:
        client = server.client()
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=4)
        err = info.value.body
        assert err["param"] == "messages" and err["type"] == "invalid_request_error"
        assert "/v1/completions" in err["message"] and "--chat-template" in err["message"]
        assert "chatml" in err["message"]
        # the completions endpoint serves the same model, and the server goes on serving
        done = client.completions.create(model=server.model, prompt="Hi there", max_tokens=4,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 4


def test_builtin_chat_template_flag(base_model):
    with serve_app(create_app(api_settings(base_model, chat_template="chatml"))) as server:
        engine = server.engine
        rendered = engine.chat_template.render(MESSAGES)
        assert rendered == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
        reply = server.client().chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=4,
                                                        extra_body={"ignore_eos": True})
        assert reply.usage.prompt_tokens == len(engine.tokenizer.encode(rendered))
        assert reply.usage.completion_tokens == 4


def test_jinja_file_chat_template_flag(base_model, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    with serve_app(create_app(api_settings(base_model, chat_template=str(template)))) as server:
        engine = server.engine
        assert engine.chat_template.render(MESSAGES) == "user: Hi there\nassistant:"
        reply = server.client().chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=3,
                                                        extra_body={"ignore_eos": True})
        assert reply.usage.prompt_tokens == len(engine.tokenizer.encode("user: Hi there\nassistant:"))


def test_unknown_chat_template_stops_serve_before_loading(base_model, capsys):
    code = main(["serve", "--model", str(base_model), "--chat-template", "no-such-template", "--port", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "no-such-template" in err and "chatml" in err
