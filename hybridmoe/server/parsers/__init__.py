"""Parsers of a chat answer: reasoning (reasoning.py), tool calls (tool_formats.py, tool_calls.py), the
grammar that forces tool calls (tool_grammar.py), and the OpenAI message/deltas (chat_output.py)."""
