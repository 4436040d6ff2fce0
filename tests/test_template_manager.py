"""Chat template resolution (flag file or built-in > tokenizer > chat_template.jinja), the no-template
path (INFO log at start-up, 400 naming --chat-template later), and message validation."""

from __future__ import annotations

import copy
import logging

import pytest

from managers.generate_input import RequestError
from managers.template_manager import BUILTIN_TEMPLATES, NO_TEMPLATE_LOG, TemplateManager
from srt.utils.hf_transformers_utils import get_tokenizer

USER_HI = [{"role": "user", "content": "hi"}]
TOKENIZER_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def base_tokenizer(qwen2_model):
    return get_tokenizer(str(qwen2_model))


@pytest.fixture
def tokenizer(base_tokenizer):
    return copy.deepcopy(base_tokenizer)  # tests change chat_template


@pytest.fixture
def bare_tokenizer(base_tokenizer):
    tok = copy.deepcopy(base_tokenizer)
    tok.chat_template = None
    return tok


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------- precedence
def test_flag_file_beats_tokenizer_template(tokenizer, tmp_path):
    flag = write(tmp_path / "mine.jinja", "{% for m in messages %}FILE:{{ m['content'] }}{% endfor %}")
    write(tmp_path / "chat_template.jinja", "BESIDE")
    tm = TemplateManager.load(tokenizer, str(flag), str(tmp_path))
    assert tm.apply(USER_HI) == "FILE:hi" and tm.source == str(flag)


def test_tokenizer_template_beats_file_beside_model(tokenizer, tmp_path):
    write(tmp_path / "chat_template.jinja", "BESIDE")
    tm = TemplateManager.load(tokenizer, None, str(tmp_path))
    assert tm.apply(USER_HI) == TOKENIZER_PROMPT


def test_file_beside_model_is_used_when_tokenizer_has_none(bare_tokenizer, tmp_path):
    path = write(tmp_path / "chat_template.jinja", "{% for m in messages %}[{{ m['role'] }}]{% endfor %}")
    tm = TemplateManager.load(bare_tokenizer, None, str(tmp_path))
    assert tm.apply(USER_HI) == "[user]" and tm.source == str(path)


def test_builtin_chatml_by_name(bare_tokenizer, tmp_path):
    tm = TemplateManager.load(bare_tokenizer, "chatml", str(tmp_path))
    assert tm.apply(USER_HI) == TOKENIZER_PROMPT
    assert tm.apply(USER_HI, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tm.apply(parts, add_generation_prompt=False) == "<|im_start|>user\na\nb<|im_end|>\n"


def test_builtin_llama3_by_name(bare_tokenizer, tmp_path):
    tm = TemplateManager.load(bare_tokenizer, "llama-3-instruct", str(tmp_path))
    prompt = tm.apply([{"role": "system", "content": "be brief "}, *USER_HI])
    assert prompt == (bare_tokenizer.bos_token + "<|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
                      "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                      "<|start_header_id|>assistant<|end_header_id|>\n\n")


# ---------------------------------------------------------------- no template anywhere
def test_no_template_logs_info_and_chat_gets_400_naming_the_flag(bare_tokenizer, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="managers.template_manager"):
        tm = TemplateManager.load(bare_tokenizer, None, str(tmp_path))
    assert NO_TEMPLATE_LOG == "No chat template found, defaulting to 'string' content format"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [NO_TEMPLATE_LOG]
    assert tm.chat_template is None and tm.content_format == "string"
    with pytest.raises(RequestError) as info:
        tm.apply(USER_HI, add_generation_prompt=True)
    assert info.value.status_code == 400 and "--chat-template" in str(info.value)


# ---------------------------------------------------------------- bad --chat-template values
def test_unknown_builtin_name_lists_the_builtins(tokenizer, tmp_path):
    with pytest.raises(ValueError) as info:
        TemplateManager.load(tokenizer, "chatmlx", str(tmp_path))
    assert "--chat-template" in str(info.value) and all(name in str(info.value) for name in BUILTIN_TEMPLATES)


def test_missing_template_file_says_it_does_not_exist(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="does not exist") as info:
        TemplateManager.load(tokenizer, str(tmp_path / "nope.jinja"), str(tmp_path))
    assert "chatml" in str(info.value)


def test_template_file_with_syntax_error_fails_at_startup_with_line(tokenizer, tmp_path):
    path = write(tmp_path / "broken.jinja", "line one\n{% for m in messages %}{{ m['content'] }}\n")
    with pytest.raises(ValueError, match=r"syntax error at line \d"):
        TemplateManager.load(tokenizer, str(path), str(tmp_path))


# ---------------------------------------------------------------- messages
@pytest.mark.parametrize("messages, match", [
    ([], "messages is empty"),
    ("hi", "messages must be a list"),
    ([{"role": "robot", "content": "x"}], "role must be one of system"),
    ([{"role": "user", "content": 5}], "content must be a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "this model accepts text only"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], r"content\[0\]\.text must be a string"),
    ([{"role": "user"}], "content is missing"),
])
def test_bad_messages_are_refused_with_400(tokenizer, tmp_path, messages, match):
    tm = TemplateManager.load(tokenizer, None, str(tmp_path))
    with pytest.raises(RequestError, match=match) as info:
        tm.apply(messages)
    assert info.value.status_code == 400


def test_assistant_tool_call_turn_may_omit_content(tokenizer, tmp_path):
    tm = TemplateManager.load(tokenizer, "chatml", str(tmp_path))
    messages = [*USER_HI, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    assert tm.apply(messages, add_generation_prompt=False).endswith("<|im_start|>assistant\n<|im_end|>\n")


def test_string_format_template_gets_text_parts_joined(bare_tokenizer, tmp_path):
    path = write(tmp_path / "plain.jinja", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tm = TemplateManager.load(bare_tokenizer, str(path), str(tmp_path))
    assert tm.content_format == "string"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert tm.apply([{"role": "user", "content": parts}]) == "a\nb"


def test_tokenizer_template_takes_openai_parts(tokenizer, tmp_path):
    tm = TemplateManager.load(tokenizer, None, str(tmp_path))
    assert tm.content_format == "openai"
    assert tm.apply([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]) == TOKENIZER_PROMPT


def test_template_raising_an_error_becomes_400_naming_its_source(tokenizer, tmp_path):
    path = write(tmp_path / "strict.jinja", "{% if messages[0]['role'] != 'system' %}"
                                           "{{ raise_exception('first message must be system') }}{% endif %}")
    tm = TemplateManager.load(tokenizer, str(path), str(tmp_path))
    with pytest.raises(RequestError, match="first message must be system") as info:
        tm.apply(USER_HI)
    assert str(path) in str(info.value) and info.value.status_code == 400
