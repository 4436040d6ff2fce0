"""Which chat template turns OpenAI-style messages into a prompt, and applying it.

Precedence: `--chat-template` (a Jinja file or a built-in name), the tokenizer's own template, a
`chat_template.jinja` beside the model. With none, chat requests get a 400 naming the flag.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Dict, List, Optional

from managers.generate_input import RequestError

logger = logging.getLogger(__name__)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# Content may be a string, None (assistant tool-call turns) or OpenAI text parts: the built-ins
# flatten parts themselves so they work whatever the client sends.
_CONTENT = (
    "{%- if message['content'] is none -%}{%- set content = '' -%}"
    "{%- elif message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- else -%}{%- set content = message['content'] | map(attribute='text') | join('\\n') -%}{%- endif -%}"
)
BUILTIN_TEMPLATES: Dict[str, str] = {
    "chatml": (
        "{%- for message in messages -%}" + _CONTENT
        + "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    ),
    "llama-3-instruct": (
        "{{- bos_token -}}{%- for message in messages -%}" + _CONTENT
        + "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + content | trim"
        " + '<|eot_id|>' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
    ),
}
MODEL_DIR_TEMPLATE_FILE = "chat_template.jinja"
# OpenAI content-part types a text-only model cannot take, and what they carry.
NON_TEXT_PARTS = {"image_url": "images", "input_image": "images", "input_audio": "audio", "audio_url": "audio",
                  "video_url": "video", "file": "files"}
NO_TEMPLATE_LOG = "No chat template found, defaulting to 'string' content format"

# A template that looks inside `content` (iterates it, tests its type, reads part fields) takes
# OpenAI-style part lists; others get the parts joined into one string first.
_OPENAI_FORMAT_HINTS = re.compile(
    r"content\s*(\]\s*)?is\s+(not\s+)?(string|iterable|sequence|mapping)"
    r"|for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)"
    r"|\[['\"]type['\"]\]|selectattr\(\s*['\"]type['\"]"
)


class TemplateManager:
    """Holds the resolved chat template (or None) and where it came from."""

    def __init__(self, tokenizer: Any, chat_template: Optional[str], source: str):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.source = source
        self.content_format = detect_content_format(chat_template)

    @classmethod
    def load(cls, tokenizer: Any, chat_template_arg: Optional[str], model_path: Optional[str]) -> "TemplateManager":
        """Resolve the template at start-up; a bad `--chat-template` raises `ValueError` here."""
        if chat_template_arg:
            template, source = _from_flag(chat_template_arg)
        else:
            template, source = _tokenizer_template(tokenizer), "the tokenizer's chat_template"
            path = os.path.join(model_path, MODEL_DIR_TEMPLATE_FILE) if model_path else None
            if template is None and path and os.path.isfile(path):
                template, source = _read_template(path), path
        if template is None:
            logger.info(NO_TEMPLATE_LOG)
            return cls(tokenizer, None, "none")
        logger.info("Chat template from %s (%s content format).", source, detect_content_format(template))
        return cls(tokenizer, template, source)

    def apply(self, messages: Any, add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """Render `messages` into a prompt string; client mistakes raise `RequestError` (400)."""
        if self.chat_template is None:
            raise RequestError(
                "This model has no chat template, so chat messages cannot be turned into a prompt. Start the "
                f"server with --chat-template (a Jinja file or a built-in name: {', '.join(BUILTIN_TEMPLATES)}), "
                "or send a plain prompt to /generate or /v1/completions.",
                400, code="chat_template_missing")
        checked = validate_messages(messages)
        if self.content_format == "string":
            checked = [_flatten_content(m) for m in checked]
        try:
            prompt = self.tokenizer.apply_chat_template(
                checked, chat_template=self.chat_template, add_generation_prompt=add_generation_prompt,
                tokenize=False, **template_kwargs)
        except Exception as exc:  # jinja TemplateError / TypeError from the template's own checks
            raise RequestError(f"The chat template ({self.source}) rejected the messages: "
                               f"{type(exc).__name__}: {exc}", 400, code="invalid_request_error") from exc
        if not isinstance(prompt, str):
            raise RequestError(f"The chat template ({self.source}) did not render a string.", 400)
        return prompt


def detect_content_format(template: Optional[str]) -> str:
    """'openai' when the template handles lists of content parts itself, else 'string'."""
    if template and _OPENAI_FORMAT_HINTS.search(template):
        return "openai"
    return "string"


def validate_messages(messages: Any) -> List[Dict[str, Any]]:
    """Check roles and content shapes; return shallow copies safe to hand to the template."""
    if not isinstance(messages, list):
        _bad(f"messages must be a list of message objects, got {type(messages).__name__}.")
    if not messages:
        _bad("messages is empty: send at least one message.")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            _bad(f"messages[{i}] must be an object, got {type(message).__name__}.")
        role = message.get("role")
        if role not in CHAT_ROLES:
            _bad(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}.")
        content = message.get("content")
        if isinstance(content, list):
            if not content:
                _bad(f"messages[{i}].content is an empty list: send a string or text parts.")
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    if kind in NON_TEXT_PARTS:
                        _bad(f"messages[{i}].content[{j}] is a content part of type {kind!r}, but this model "
                             f"accepts text only: send text parts {{\"type\": \"text\", \"text\": ...}} (serve a "
                             f"multimodal model for {NON_TEXT_PARTS[kind]}).")
                    _bad(f"messages[{i}].content[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}; "
                         f"got {kind!r} (only text content is supported).")
                if not isinstance(part.get("text"), str):
                    _bad(f"messages[{i}].content[{j}].text must be a string.")
            content = [dict(part) for part in content]
        elif content is None:
            if role != "assistant" or not message.get("tool_calls"):
                _bad(f"messages[{i}].content is missing (only an assistant message with tool_calls may omit it).")
        elif not isinstance(content, str):
            _bad(f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}.")
        out.append({**message, "content": content})
    return out


def _flatten_content(message: Dict[str, Any]) -> Dict[str, Any]:
    content = message["content"]
    if isinstance(content, list):
        return {**message, "content": "\n".join(part["text"] for part in content)}
    if content is None:
        return {**message, "content": ""}
    return message


def _bad(message: str) -> None:
    raise RequestError(message, 400, code="invalid_request_error", param="messages")


def _from_flag(value: str) -> tuple:
    if os.path.isfile(value):
        return _read_template(value), value
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value], f"the built-in template {value!r}"
    looks_like_path = os.sep in value or value.endswith((".jinja", ".j2", ".jinja2", ".txt"))
    what = f"file {value!r} does not exist" if looks_like_path else f"{value!r} is neither a file nor a built-in name"
    raise ValueError(f"Invalid --chat-template: {what}. Pass a Jinja template file or one of the built-in "
                     f"templates: {', '.join(BUILTIN_TEMPLATES)}.")


def _read_template(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"Cannot read the chat template file {path}: {exc}") from exc
    if not text.strip():
        raise ValueError(f"The chat template file {path} is empty.")
    _check_syntax(text, path)
    return text


def _check_syntax(template: str, source: str) -> None:
    """A broken template file fails at start-up with its line, not on the first chat request."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
        compile_template = env.from_string
    import jinja2

    try:
        compile_template(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"The chat template {source} has a syntax error at line {exc.lineno}: {exc.message}") from exc


def _tokenizer_template(tokenizer: Any) -> Optional[str]:
    """The tokenizer's template; a dict of named templates (transformers) yields its 'default'."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template.strip() else None
