"""A chat template that renders OpenAI tools, tool calls and tool results in ``kvrelay serve``'s tool format, put
in front of a model's own template by ``kvrelay export-hf``.

Neither embedded model's template (SmolLM2's, Gemma 3's) renders ``tools``: a server that renders prompts with the
folder's template (vLLM with ``--enable-auto-tool-choice --tool-call-parser hermes``) would otherwise show the
model no tools and fail on an assistant message whose ``content`` is null. The preamble rewrites the messages as
``kvrelay serve`` does before its template runs (kvrelay/server/tools.py, docs/agents.md "Chat completions: tools
and structured output"): the tools' JSON schemas appended to the system message, an assistant's calls written
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` one per line (a format vLLM's ``hermes`` parser reads
and its grammar for forced calls allows), tool results merged into one user turn of ``<tool_response>`` blocks.
The same conversation therefore gives the same prompt ids on vLLM and on ``kvrelay serve``, so the two share
spans, and the call text a later step renders is the text the model generated (its decode KV is an exact
prefix). Content sent as an array of text parts is joined into its text first, as kvrelay serve reads it (a
template transformers runs gets the parts as sent). Messages without tools and tool turns render exactly as the
model's own template renders them.

The text is kvrelay serve's (kvrelay.weights may not import kvrelay.server); tests/weights/test_tool_template.py
renders both on the same conversations and compares.
"""

from __future__ import annotations

# Jinja: "{%-" / "-%}" everywhere, so that the preamble writes nothing and the model's template starts the output
_PREAMBLE = r"""{%- set kv = namespace(out=[], tool_turn=false) -%}
{%- for m in messages -%}
  {%- set role = 'system' if m.role == 'developer' else m.role -%}
  {#- the message's text as kvrelay serve reads it (ChatMessage.text): content parts joined, a refusal part's
      words as text, a null content the message's refusal -#}
  {%- set joined = namespace(text='') -%}
  {%- if m.content is string -%}
    {%- set joined.text = m.content -%}
  {%- elif m.content is none or m.content is undefined -%}
    {%- set joined.text = m.refusal or '' -%}
  {%- else -%}
    {%- for part in m.content -%}
      {%- set joined.text = joined.text + (part.text if part.type == 'text' else (part.refusal or '')) -%}
    {%- endfor -%}
  {%- endif -%}
  {%- set text = joined.text -%}
  {%- if role == 'assistant' and m.tool_calls -%}
    {%- set calls = namespace(text='') -%}
    {%- for c in m.tool_calls -%}
      {%- set f = c.function if c.function is defined else c -%}
      {%- set args = f.arguments if f.arguments is string else (f.arguments | tojson) -%}
      {%- set calls.text = calls.text + ('' if loop.first else '\n') + '<tool_call>{"name": ' + (f.name | tojson)
          + ', "arguments": ' + args + '}</tool_call>' -%}
    {%- endfor -%}
    {%- set kv.out = kv.out + [{'role': 'assistant', 'content': text + calls.text}] -%}
    {%- set kv.tool_turn = false -%}
  {%- elif role == 'tool' -%}
    {%- set found = namespace(name='') -%}
    {%- for earlier in messages -%}
      {%- for c in (earlier.tool_calls or []) -%}
        {%- if c.id == m.tool_call_id -%}
          {%- set found.name = (c.function.name if c.function is defined else c.name) -%}
        {%- endif -%}
      {%- endfor -%}
    {%- endfor -%}
    {%- set block = ('<tool_response name="' + found.name + '">' if found.name else '<tool_response>') + '\n'
        + text + '\n</tool_response>' -%}
    {%- if kv.tool_turn -%}
      {%- set kv.out = kv.out[:-1] + [{'role': 'user', 'content': kv.out[-1].content + '\n' + block}] -%}
    {%- else -%}
      {%- set kv.out = kv.out + [{'role': 'user', 'content': block}] -%}
      {%- set kv.tool_turn = true -%}
    {%- endif -%}
  {%- elif role == 'user' and kv.tool_turn -%}
    {%- set kv.out = kv.out[:-1] + [{'role': 'user', 'content': kv.out[-1].content + '\n\n' + text}] -%}
  {%- else -%}
    {%- set kv.out = kv.out + [{'role': role, 'content': text}] -%}
    {%- set kv.tool_turn = false -%}
  {%- endif -%}
{%- endfor -%}
{%- if tools is defined and tools -%}
  {%- set listing = namespace(text="You can call these tools. Each is a JSON object with the tool's name, what it does "
      + "and the JSON schema of its arguments:") -%}
  {%- for tool in tools -%}
    {%- set fn = tool.function if tool.function is defined else tool -%}
    {%- set spec = {'name': fn.name, 'description': fn.description or '',
        'parameters': fn.parameters if fn.parameters is mapping
                      else {'type': 'object', 'properties': {}, 'additionalProperties': false}} -%}
    {%- set listing.text = listing.text + '\n' + (spec | tojson) -%}
  {%- endfor -%}
  {%- set listing.text = listing.text + '\nTo call a tool, answer with <tool_call>{"name": <tool name>, "arguments": '
      + '<arguments object>}</tool_call>, one call per line. The results come back as <tool_response> blocks.' -%}
  {%- if kv.out and kv.out[0].role == 'system' -%}
    {%- set head = (kv.out[0].content + '\n\n' + listing.text) if kv.out[0].content else listing.text -%}
    {%- set kv.out = [{'role': 'system', 'content': head}] + kv.out[1:] -%}
  {%- else -%}
    {%- set kv.out = [{'role': 'system', 'content': listing.text}] + kv.out -%}
  {%- endif -%}
{%- endif -%}
{%- set messages = kv.out -%}
{%- set tools = none -%}
"""


def tool_chat_template(model_template: str) -> str:
    """``model_template`` (a chat template that knows no tools) behind the preamble that renders tools, calls
    and results in kvrelay serve's format. A template that already starts with the preamble is returned as it is."""
    if model_template.startswith(_PREAMBLE):
        return model_template
    return _PREAMBLE + model_template
