"""`--chat-template`: a Jinja file, or one of the built-in templates below (written for hybridmoe;
rendered by server/templates.py like a tokenizer's own, with bos_token/eos_token defined). Also the
checks of a chat template's source, which the startup runs on the model's own templates too
(model_check.check_chat_templates): it compiles, and it is of a plausible size."""

from __future__ import annotations

import os
import stat
from pathlib import Path

# Published chat templates are at most tens of KB; compiling takes about 5 s per MiB (a hostile 1 TiB
# template file would have been read whole, and compiled for hours).
MAX_TEMPLATE_BYTES = 1 << 20

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


def read_template_file(path: Path, where: str) -> str:
    """The text of a chat template file; ValueError starting with `where` when it is not a regular file (a FIFO
    blocked its reader forever), is larger than any chat template, or is not UTF-8."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{where}: not a regular file")
        if st.st_size > MAX_TEMPLATE_BYTES:
            raise ValueError(f"{where}: {st.st_size} bytes, more than a chat template can be "
                             f"({MAX_TEMPLATE_BYTES >> 20} MiB)")
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"{where}: cannot be read: {e.strerror or e}") from None


def check_template(source: str, where: str) -> None:
    """`source` compiles in the environment the chat routes render with (server/templates.py); ValueError
    starting with `where` naming the Jinja error and its line otherwise. A broken template passed the startup and
    then failed every /v1/chat/completions request, or `generate --chat` after the whole model load."""
    from jinja2 import TemplateError, TemplateSyntaxError

    from hybridmoe.server.templates import compile_template

    if len(source) > MAX_TEMPLATE_BYTES:  # characters, each at least a byte
        raise ValueError(f"{where}: {len(source)} characters, more than a chat template can be "
                         f"({MAX_TEMPLATE_BYTES >> 20} MiB)")
    try:
        compile_template(source)
    except TemplateSyntaxError as e:  # unknown filters and tests are found at compile time too
        line = f" (line {e.lineno} of the template)" if e.lineno else ""
        raise ValueError(f"{where}: not a valid Jinja template: {' '.join(str(e.message or e).split())}{line}") \
            from None
    except RecursionError:  # the parser recurses per nesting level: (((...))) 5000 deep
        raise ValueError(f"{where}: not a valid Jinja template: nested too deeply") from None
    except (TemplateError, SyntaxError, ValueError, OverflowError, MemoryError) as e:  # e.g. Python's compile of
        # the generated code refusing it
        raise ValueError(f"{where}: not a valid Jinja template: {type(e).__name__}: {' '.join(str(e).split())}") \
            from None


def load_chat_template(value: str) -> str:
    """The Jinja source of `--chat-template value`, compiled once to check it; ValueError saying why when it is
    neither a template file nor a built-in name, or does not compile."""
    where = f"--chat-template {value}"
    path = Path(value)
    # a file first (as before); something else of that name (a FIFO, a directory) is named, not "no such file"
    if path.is_file() or (path.exists() and value not in BUILTIN_TEMPLATES):
        if path.suffix == ".json":
            raise ValueError(f"{where}: JSON conversation templates (SGLang's own format) are not "
                             "supported; give a Jinja template file or a built-in name")
        text = read_template_file(path, where)
        if not text.strip():
            raise ValueError(f"{where}: the file is empty")
        check_template(text, where)
        return text
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    raise ValueError(f"--chat-template {value}: no such file, and not a built-in template name "
                     f"({', '.join(BUILTIN_TEMPLATES)})")
