"""ChatTemplate: ChatML rendering, HF helpers, sandboxing, errors as InvalidRequestError."""

from __future__ import annotations

import pytest

from engine.chat_template import ChatTemplate
from engine.types import InvalidRequestError, ModelLoadError

# SmolLM2-Instruct's template (ChatML with a default system prompt).
SMOL = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOOLS = (
    "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{% if m.role not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('Unknown role: ' + m.role) }}{% endif %}"
    "{{ bos_token }}{{ m.role }}: {{ m.content }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_chatml_with_default_system_and_generation_prompt():
    t = ChatTemplate(SMOL)
    out = t.render([{"role": "user", "content": "Hi"}])
    assert out == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                   "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_system_message_replaces_default_and_no_generation_prompt():
    t = ChatTemplate(SMOL)
    out = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                   add_generation_prompt=False)
    assert out == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_tools_special_tokens_and_tojson_keep_unicode():
    t = ChatTemplate.from_tokenizer_config({"chat_template": TOOLS, "bos_token": "<s>",
                                            "eos_token": {"content": "</s>", "lstrip": False}})
    out = t.render([{"role": "user", "content": "¿Qué?"}], tools=[{"name": "météo"}])
    assert out == 'TOOLS:[{"name": "météo"}]\n<s>user: ¿Qué?</s>\nassistant:'


def test_raise_exception_becomes_invalid_request():
    t = ChatTemplate(TOOLS)
    with pytest.raises(InvalidRequestError, match="Unknown role: robot") as info:
        t.render([{"role": "robot", "content": "x"}])
    assert info.value.param == "messages"


def test_sandbox_blocks_mutation_and_attribute_escape():
    t = ChatTemplate("{{ messages.append(1) }}")
    with pytest.raises(InvalidRequestError):
        t.render([{"role": "user", "content": "x"}])
    t = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidRequestError):
        t.render([])


def test_strftime_now_and_loopcontrols():
    t = ChatTemplate("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
                     "{% endfor %}|{{ strftime_now('%Y') | length }}")
    assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a|4"


def test_named_template_list_and_missing_template():
    cfg = {"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]}
    t = ChatTemplate.from_tokenizer_config(cfg)
    assert t.render([]) == "D" and t.render([], tools=[{"name": "f"}]) == "T"
    empty = ChatTemplate.from_tokenizer_config({})
    assert not empty.available
    with pytest.raises(InvalidRequestError, match="no chat template"):
        empty.render([{"role": "user", "content": "x"}])


def test_template_that_does_not_compile_is_a_load_error():
    with pytest.raises(ModelLoadError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_supports_tools_is_decided_by_rendering_a_probe_tool():
    assert ChatTemplate(TOOLS).supports_tools
    assert not ChatTemplate(SMOL).supports_tools  # SmolLM2 never renders tools
    # Mentioning `tools` is not rendering them; a template that fails on the probe cannot take tools either.
    assert not ChatTemplate("{% if tools %}You have tools.{% endif %}{{ messages[0].content }}").supports_tools
    assert not ChatTemplate("{{ raise_exception('no') }}").supports_tools
    named = ChatTemplate.from_tokenizer_config(
        {"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "{{ tools }}"}]})
    assert named.supports_tools and named.tool_source == "{{ tools }}"
    assert not ChatTemplate.from_tokenizer_config({}).supports_tools
