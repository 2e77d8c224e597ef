"""Tool calling: `tools` / `tool_choice` / `parallel_tool_calls` -> prompt text, a constraint, parsed calls.

    request: tools [{type: function, function: {name, description, parameters}}], tool_choice
        none | auto | required | {type: function, function: {name}}, parallel_tool_calls
        -> parse() -> ToolSpec (ConstraintError names the parameter)
    prompt: render_messages(): the tools go into the system message in Hermes' format (chat
        templates without tool support, SmolLM2's among them, render it as plain text);
        assistant tool calls become <tool_call>{"name", "arguments"}</tool_call> blocks and tool
        results (role "tool") user turns holding <tool_response>...</tool_response>
    constraint (as vLLM does): a named function -> its parameters schema (the output is the
        arguments); required -> a JSON array of {"name", "parameters"} objects, one item unless
        parallel_tool_calls; auto / none -> no constraint
    output -> calls(): [ToolCall] (id, name, arguments as a JSON string) and any other content
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from .request import Constraint, ConstraintError

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
TOOL_CALL_OPEN = "<tool_call>"

SYSTEM_TEMPLATE = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: str            # JSON schema as sorted JSON


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    tools: tuple[Tool, ...]
    choice: str                # "none" | "auto" | "required" | "function" (named)
    named: str | None = None   # the forced function's name
    parallel: bool = True

    @property
    def constraint(self) -> Constraint | None:
        if self.choice == "function":
            tool = next(t for t in self.tools if t.name == self.named)
            return Constraint("json_schema", tool.parameters, "tool_choice")
        if self.choice == "required":
            items = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name},
                                                                  "parameters": json.loads(t.parameters)},
                                "required": ["name", "parameters"]} for t in self.tools]}
            schema = {"type": "array", "items": items, "minItems": 1}
            if not self.parallel:
                schema["maxItems"] = 1
            return Constraint("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")), "tools")
        return None

    @property
    def rendered(self) -> bool:
        """Whether the prompt lists the tools (auto and required; a named call needs no listing)."""
        return self.choice in ("auto", "required")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str             # JSON text

    def body(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d = {"index": index, **d}
        return d


def new_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def parse(tools: Any, tool_choice: Any, parallel: Any) -> ToolSpec | None:
    """The request's tool settings; None when it sends no tools (tool_choice "none" alone is fine)."""
    if parallel is not None and not isinstance(parallel, bool):
        raise ConstraintError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ConstraintError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ConstraintError("'tools' must be a list of tool objects", "tools")
    if len(tools) > MAX_TOOLS:
        raise ConstraintError(f"'tools' has {len(tools)} entries; at most {MAX_TOOLS} are allowed", "tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ConstraintError(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConstraintError(f"'{where}.function.name' must be 1-64 letters, digits, _ . : -", f"{where}.function.name")
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise ConstraintError(f"'{where}.function.description' must be a string", f"{where}.function.description")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ConstraintError(f"'{where}.function.parameters' must be a JSON schema object",
                                  f"{where}.function.parameters")
        extra = [k for k in fn if k not in ("name", "description", "parameters", "strict")]
        if extra:
            raise ConstraintError(f"unsupported field '{where}.function.{extra[0]}'", f"{where}.function.{extra[0]}")
        out.append(Tool(name, desc, json.dumps(params, sort_keys=True, separators=(",", ":"))))
    if len({t.name for t in out}) != len(out):
        raise ConstraintError("'tools' holds two functions with the same name", "tools")
    choice, named = "auto", None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ConstraintError("'tool_choice' must be none, auto, required or "
                                  "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        named = fn["name"]
        if named not in {t.name for t in out}:
            raise ConstraintError(f"'tool_choice' names '{named[:64]}', which is not in 'tools'", "tool_choice")
        choice = "function"
    elif tool_choice is not None:
        if tool_choice not in ("none", "auto", "required"):
            raise ConstraintError("'tool_choice' must be none, auto, required or a named function", "tool_choice")
        choice = tool_choice
    return ToolSpec(tuple(out), choice, named, True if parallel is None else parallel)


def system_text(spec: ToolSpec) -> str:
    lines = [json.dumps({"type": "function", "function": {"name": t.name, "description": t.description,
                                                          "parameters": json.loads(t.parameters)}})
             for t in spec.tools]
    return SYSTEM_TEMPLATE.format(tools="\n".join(lines))


def render_messages(messages: list[dict], spec: ToolSpec | None) -> list[dict]:
    """Chat messages as plain {role, content} for any template: tool calls and results as text,
    the tools in the system message."""
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
            continue
        calls = m.get("tool_calls") or ()
        if calls:
            blocks = [f"<tool_call>\n{json.dumps({'name': c['name'], 'arguments': _loads(c['arguments'])})}\n</tool_call>"
                      for c in calls]
            content = "\n".join(([content] if content else []) + blocks)
        out.append({"role": role, "content": content})
    if spec is not None and spec.rendered:
        text = system_text(spec)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def calls(text: str, spec: ToolSpec) -> tuple[list[ToolCall], str | None]:
    """The tool calls in a finished output and the content left beside them."""
    if spec.choice == "function":
        return [ToolCall(new_id(), spec.named, text.strip())], None
    if spec.choice == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return [], text
        return [ToolCall(new_id(), it["name"], json.dumps(it.get("parameters", {})))
                for it in items if isinstance(it, dict) and isinstance(it.get("name"), str)], None
    if spec.choice != "auto" or TOOL_CALL_OPEN not in text:
        return [], text
    found = []
    for block in _CALL.findall(text):
        try:
            obj = json.loads(block)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments", obj.get("parameters", {}))
            found.append(ToolCall(new_id(), obj["name"], args if isinstance(args, str) else json.dumps(args)))
    if not found:
        return [], text
    rest = text[:text.index(TOOL_CALL_OPEN)].strip()
    return found, rest or None
