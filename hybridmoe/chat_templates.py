"""`--chat-template`: a Jinja file, or one of the built-in templates below (written for hybridmoe;
rendered by server/templates.py like a tokenizer's own, with bos_token/eos_token defined)."""

from __future__ import annotations

from pathlib import Path

# ChatML (Qwen, many fine-tunes): <|im_start|>role\ncontent<|im_end|>\n per message
_CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Llama 3 instruct: a header per message, each message ended by <|eot_id|>
_LLAMA3 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

BUILTIN_TEMPLATES: dict[str, str] = {"chatml": _CHATML, "qwen": _CHATML, "llama-3-instruct": _LLAMA3}


def load_chat_template(value: str) -> str:
    """The Jinja source of `--chat-template value`; ValueError saying why when it is neither."""
    path = Path(value)
    if path.is_file():
        if path.suffix == ".json":
            raise ValueError(f"--chat-template {value}: JSON conversation templates (SGLang's own format) are not "
                             "supported; give a Jinja template file or a built-in name")
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            raise ValueError(f"--chat-template {value}: the file is empty")
        return text
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    raise ValueError(f"--chat-template {value}: no such file, and not a built-in template name "
                     f"({', '.join(BUILTIN_TEMPLATES)})")
