"""OpenAI tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`.

* The chat template renders the tools (`apply_chat_template(tools=...)`), unless `tool_choice`
  is "none".
* `auto`: the model decides; a parser chosen by `--tool-call-parser` finds calls in its text.
  `hermes` (Qwen 2.5 / Hermes templates): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
  `llama3`: a JSON object `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`).
* `required` or a named function: the output is constrained by a JSON schema built from the
  functions' parameter schemas, so any model returns a valid call (parsed as JSON, any parser).

Calls become `message.tool_calls` (ids `call_<hex>`), `finish_reason` "tool_calls"; streaming sends
text as `delta.content` and each call as one `delta.tool_calls` entry once it is complete.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from srt.entrypoints.openai.protocol import invalid

TOOL_CALL_PARSERS = ("hermes", "qwen25", "llama3")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass
class ToolPlan:
    """What a request asks of tools: the rendered tool list, the choice, the constraint."""

    tools: List[Dict[str, Any]]
    choice: str  # "none" | "auto" | "required" | "named"
    named: Optional[str] = None
    parallel: bool = True
    names: List[str] = field(default_factory=list)

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    def grammar_schema(self) -> Optional[str]:
        """JSON schema of one call `{"name": <a tool>, "arguments": <its parameters>}`."""
        if not self.constrained:
            return None
        options = []
        for tool in self.tools:
            fn = tool["function"]
            if self.named is not None and fn["name"] != self.named:
                continue
            params = fn.get("parameters") or {"type": "object"}
            options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                            "required": ["name", "arguments"], "additionalProperties": False})
        return json.dumps(options[0] if len(options) == 1 else {"anyOf": options})


def parse_tool_plan(body: Dict[str, Any]) -> Optional[ToolPlan]:
    """Validate `tools` / `tool_choice` / `parallel_tool_calls` (400 naming the field); None when
    the request uses no tools."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "auto", "none"):
            raise invalid(f"tool_choice {choice!r} needs tools; none were given.", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise invalid(f"tools must be a list of {{type: function, function: {{name, parameters}}}}, got {tools!r}.",
                      "tools")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise invalid(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}, got {tool!r}.",
                          f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise invalid(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -, got {name!r}.",
                          f"tools[{i}].function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise invalid(f"tools[{i}].function.parameters must be a JSON schema object, got {params!r}.",
                          f"tools[{i}].function.parameters")
        names.append(name)
    parallel = body.get("parallel_tool_calls")
    plan = ToolPlan(tools=tools, choice="auto", parallel=True if parallel is None else bool(parallel), names=names)
    if choice in (None, "auto", "none", "required"):
        plan.choice = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise invalid(f"tool_choice names the function {name!r}, which is not among the tools "
                          f"({', '.join(names)}).", "tool_choice")
        plan.choice, plan.named = "named", name
    else:
        raise invalid(f"tool_choice must be 'none', 'auto', 'required' or {{type: function, function: {{name}}}}, "
                      f"got {choice!r}.", "tool_choice")
    return plan


def new_call(name: str, arguments: Any, index: int) -> Dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}


def _call_from_json(text: str, names: List[str]) -> Optional[Tuple[str, Any]]:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args


class ToolCallParser:
    """Finds tool calls in model text, whole (`parse`) or as it streams (`feed`)."""

    def __init__(self, plan: ToolPlan, parser: str = "hermes"):
        self.plan, self.parser = plan, parser
        self.buffer = ""
        self.emitted = 0

    def parse(self, text: str) -> Tuple[Optional[str], List[Dict[str, Any]]]:
        """(content, calls) of a finished output."""
        if self.plan.constrained:
            found = _call_from_json(text.strip(), self.plan.names)
            return (None, [new_call(*found, 0)]) if found else (text, [])
        if self.parser == "llama3":
            body = text.split("<|python_tag|>", 1)[-1].strip()
            found = _call_from_json(body, self.plan.names)
            return (None, [new_call(*found, 0)]) if found else (text, [])
        calls, content = [], text
        for match in _HERMES.finditer(text):
            found = _call_from_json(match.group(1), self.plan.names)
            if found:
                calls.append(new_call(*found, len(calls)))
        if calls:
            content = _HERMES.sub("", text).strip() or None
        return content, calls

    def feed(self, delta: str, final: bool) -> Tuple[str, List[Dict[str, Any]]]:
        """(text safe to stream as content now, calls completed by this delta)."""
        self.buffer += delta
        if self.plan.constrained or self.parser == "llama3":  # the whole output is the call
            if not final:
                return "", []
            content, calls = self.parse(self.buffer)
            self.emitted += len(calls)
            return (content or "") if not calls else "", calls
        out, calls = "", []
        while True:
            start = self.buffer.find("<tool_call>")
            if start < 0:
                keep = _partial_tag_len(self.buffer) if not final else 0
                out += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return out, calls
            out += self.buffer[:start]
            end = self.buffer.find("</tool_call>", start)
            if end < 0:
                self.buffer = self.buffer[start:]
                if final:  # an unclosed call is text
                    out, self.buffer = out + self.buffer, ""
                return out, calls
            found = _call_from_json(self.buffer[start + len("<tool_call>"):end].strip(), self.plan.names)
            if found:
                calls.append(new_call(*found, self.emitted))
                self.emitted += 1
            else:
                out += self.buffer[start:end + len("</tool_call>")]
            self.buffer = self.buffer[end + len("</tool_call>"):]


def _partial_tag_len(text: str) -> int:
    """Length of a suffix of `text` that could start `<tool_call>` (held back while streaming)."""
    tag = "<tool_call>"
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
