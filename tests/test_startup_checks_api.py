"""The startup checks everywhere a model is started, and the last gaps they had:

- the in-process API (`hybridmoe.LLM`) runs the checks of `generate` and `serve` (startup.prepare): a hostile
  config.json is one CheckpointError line there too, not a hang (2^31-1 layers) or an error from deep inside;
  the shards are scanned only where the command line scans them (not with --load-format dummy), and the
  command line still runs the checks once;
- the weight loader's index reader refuses a malformed model.safetensors.index.json with the line the startup
  scan gives (a list as weight_map was an AttributeError);
- a chat template that is not valid Jinja (tokenizer_config.json's chat_template, chat_template.jinja,
  additional_chat_templates/*.jinja, a GGUF's tokenizer.chat_template, --chat-template) is refused at startup
  naming the file, the Jinja error and its line; before, it failed each /v1/chat/completions request (a 400
  blaming the messages) or `generate --chat` after the whole load;
- `generate` without a tokenizer (its --prompt is text) is refused before the model loads, naming the
  directory and --tokenizer-path; `serve` still starts such a model (token ids in and out).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridmoe.cli import main as cli_main
from hybridmoe.config import ConfigError, EngineArgs
from hybridmoe.engine.llm import LLM
from hybridmoe.startup import prepare
from hybridmoe.weights.errors import CheckpointError

from tiny_models import DROP, linked_with_json, one_line

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "hybridmoe" / "demo_model"
BIG = 2**31 - 1
# a syntax error on the template's second line (an unclosed `{{ ... }`)
BROKEN = "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}"
GOOD = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
# every case must fail fast: a hang (what some of them were) is a test failure, not a stuck run
pytestmark = pytest.mark.timeout(60)


def _model_with_config(src: Path, dst: Path, changes: dict) -> Path:
    """A model directory at dst: src's files (linked) with config.json changed by `changes`."""
    return linked_with_json(src, dst, "config.json", changes)


def _demo(dst: Path, **tokenizer_config: object) -> Path:
    """The demo model at dst (files linked) with its tokenizer_config.json changed: a value None removes the key."""
    changes = {k: DROP if v is None else v for k, v in tokenizer_config.items()}
    return linked_with_json(DEMO, dst, "tokenizer_config.json", changes)


@pytest.fixture
def never_load(monkeypatch):
    """A case the checks refuse must not get to loading the model: LLM is made a test failure."""
    def started(*a: object, **k: object) -> None:
        raise AssertionError("STARTED: the checks let a bad case through")

    class Started:
        __init__ = started
        from_prepared = staticmethod(started)

    monkeypatch.setattr("hybridmoe.engine.llm.LLM", Started)
    monkeypatch.setattr("hybridmoe.server.run.run_server", started)


def _cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    """(exit code, stderr lines) of `hybridmoe ARGV` in this process."""
    capsys.readouterr()  # what fixtures printed before (a tiny model's first "Writing model shards" bar)
    try:
        rc = cli_main(argv)
    except SystemExit as e:  # argparse errors
        rc = e.code
    return rc, capsys.readouterr().err.splitlines()


def _one_error_line(rc: int, lines: list[str], prog: str, *want: str) -> str:
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"{prog}: error: ") and "Traceback" not in lines[0], lines
    for w in want:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _process(argv: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "hybridmoe.cli", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=50, env=env)


# ---- 1. the in-process API runs the startup checks ------------------------------------------------------
@pytest.mark.parametrize(("kind", "changes", "field"), [
    ("qwen3_moe", {"num_hidden_layers": BIG}, f"num_hidden_layers is {BIG}"),  # was a hang
    ("mixtral", {"num_local_experts": BIG}, f"num_local_experts is {BIG}"),  # was a hang
    # was an error naming a tensor's shape, not the field
    ("qwen3_moe", {"num_key_value_heads": 4}, "num_key_value_heads is 4"),
], ids=["layers_huge", "experts_huge", "kv_heads_not_dividing"])
def test_llm_refuses_a_hostile_config_inone_line(tiny_model_dir, tmp_path, kind, changes, field):
    model = _model_with_config(tiny_model_dir(kind), tmp_path / "m", changes)
    with pytest.raises(CheckpointError) as e:
        LLM(model_path=str(model), device="cpu", progress=False)
    one_line(e, f"{model}/config.json: {field}")


def test_llm_checks_the_shards_only_where_the_command_line_does(tiny_model_dir, monkeypatch):
    """check_weights scans every shard header and builds the model on the meta device: not with dummy weights
    (tests and benchmarks start many of those, often from a config.json alone), as `generate` and `serve`."""
    import hybridmoe.startup as startup

    model = str(tiny_model_dir("qwen3_moe"))
    calls: list[str] = []
    real = startup.check_weights

    def counted(path: str, *a: object, **k: object):
        calls.append(path)
        return real(path, *a, **k)

    monkeypatch.setattr(startup, "check_weights", counted)
    LLM(model_path=model, device="cpu", progress=False, load_format="dummy").shutdown()
    assert calls == []
    LLM(model_path=model, device="cpu", progress=False).shutdown()
    assert calls == [model]


def test_generate_runs_the_checks_once(monkeypatch, capsys):
    """The command line checks before it builds the LLM, which then does not check again."""
    import hybridmoe.startup as startup

    calls: list[str] = []
    real = startup.prepare

    def counted(args: EngineArgs) -> EngineArgs:
        calls.append(args.model_path)
        return real(args)

    monkeypatch.setattr(startup, "prepare", counted)
    rc = cli_main(["generate", "--device", "cpu", "--model", str(DEMO), "--max-new-tokens", "1", "--prompt", "Hi"])
    assert rc == 0 and calls == [str(DEMO)], capsys.readouterr().err


# ---- 2. the loader's index reader: the startup scan's validation -----------------------------------------
@pytest.mark.parametrize("index", [
    {"metadata": {}, "weight_map": [["model.norm.weight", "model.safetensors"]]},  # was an AttributeError
    {"weight_map": {"model.norm.weight": 5}},  # was a TypeError (a path joined with an int)
    {"weight_map": "model.safetensors"},
    {"metadata": {}},
    [1],
], ids=["weight_map_list", "file_not_a_string", "weight_map_string", "no_weight_map", "index_a_list"])
def test_loader_refuses_a_malformed_index_as_the_startup_scan_does(tiny_model_dir, tmp_path, index):
    from hybridmoe.weights.loader import SafetensorsIndex
    from hybridmoe.weights.shards import scan_checkpoint

    model = _model_with_config(tiny_model_dir("qwen3_moe"), tmp_path / "m", {})
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as scanned:
        scan_checkpoint(model)
    with pytest.raises(CheckpointError) as loaded:
        SafetensorsIndex(str(model))
    assert str(loaded.value) == str(scanned.value)
    one_line(loaded, f"{model}/model.safetensors.index.json: not a safetensors index")


# ---- 3. chat templates are compiled at startup ------------------------------------------------------------
def _jinja(model: Path, name: str, text: str | bytes) -> None:
    f = model / name
    f.parent.mkdir(exist_ok=True)
    f.write_bytes(text if isinstance(text, bytes) else text.encode())


def _fifo(model: Path, name: str) -> None:
    f = model / name
    f.parent.mkdir(exist_ok=True)
    os.mkfifo(f)


def _huge(model: Path, name: str) -> None:
    f = model / name
    f.write_bytes(b"{{")
    os.truncate(f, 1 << 40)  # sparse: no disk used


# (case id, tokenizer_config.json changes, what else to write, what the one line must say)
TEMPLATE_CASES = [
    ("config_string", {"chat_template": BROKEN}, None,
     ["tokenizer_config.json: chat_template: not a valid Jinja template: unexpected '}' (line 2 of the template)"]),
    ("config_unknown_filter", {"chat_template": "{{ messages | nosuch }}"}, None,
     ["tokenizer_config.json: chat_template: not a valid Jinja template: No filter named 'nosuch'"]),
    ("config_named_list", {"chat_template": [{"name": "default", "template": GOOD},
                                             {"name": "rag", "template": BROKEN}]}, None,
     ["tokenizer_config.json: chat_template 'rag': not a valid Jinja template: unexpected '}' (line 2"]),
    ("config_not_a_string", {"chat_template": 5}, None,
     ["tokenizer_config.json: chat_template is 5, expected a string or a list of {name, template}"]),
    ("config_list_of_junk", {"chat_template": [1, 2]}, None,
     ["tokenizer_config.json: chat_template is [1, 2], expected a string or a list of {name, template}"]),
    ("config_nested_too_deeply", {"chat_template": "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}"}, None,
     ["tokenizer_config.json: chat_template: not a valid Jinja template: nested too deeply"]),
    ("jinja_file", {"chat_template": None}, lambda m: _jinja(m, "chat_template.jinja", "\n\n" + BROKEN),
     ["chat_template.jinja: not a valid Jinja template: unexpected '}' (line 4 of the template)"]),
    ("additional_template", {}, lambda m: _jinja(m, "additional_chat_templates/tool_use.jinja", BROKEN),
     ["additional_chat_templates/tool_use.jinja: not a valid Jinja template: unexpected '}'"]),
    ("jinja_not_utf8", {}, lambda m: _jinja(m, "chat_template.jinja", b"{{ '\xff' }}"),
     ["chat_template.jinja: not UTF-8 text"]),
    # transformers reads every additional_chat_templates/*.jinja whole: a FIFO hung the tokenizer load
    ("additional_template_fifo", {}, lambda m: _fifo(m, "additional_chat_templates/x.jinja"),
     ["additional_chat_templates/x.jinja: not a regular file"]),
    ("jinja_huge", {}, lambda m: _huge(m, "chat_template.jinja"),
     ["chat_template.jinja: 1099511627776 bytes, more than a chat template can be"]),
]


@pytest.mark.parametrize(("config", "write", "want"), [c[1:] for c in TEMPLATE_CASES],
                         ids=[c[0] for c in TEMPLATE_CASES])
def test_a_broken_chat_template_is_refused_at_startup(tmp_path, config, write, want):
    model = _demo(tmp_path / "m", **config)
    if write is not None:
        write(model)
    with pytest.raises(CheckpointError) as e:
        prepare(EngineArgs.from_kwargs(model_path=str(model), device="cpu"))
    msg = one_line(e, str(model), *want)
    assert "--chat-template" in msg  # the way out: another template


def test_templates_that_work_pass(tmp_path):
    """No template at all (token ids and /v1/completions still serve), one given by --chat-template over a
    broken one of the model's (the flag replaces it), and a chat_template.jinja over a broken tokenizer_config.json
    value (transformers reads the file, not the value)."""
    absent = _demo(tmp_path / "absent", chat_template=None)
    prepare(EngineArgs.from_kwargs(model_path=str(absent), device="cpu"))
    broken = _demo(tmp_path / "broken", chat_template=BROKEN)
    prepare(EngineArgs.from_kwargs(model_path=str(broken), device="cpu", chat_template="chatml"))
    over = _demo(tmp_path / "over", chat_template=BROKEN)
    _jinja(over, "chat_template.jinja", GOOD)
    prepare(EngineArgs.from_kwargs(model_path=str(over), device="cpu"))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(over)).chat_template == GOOD


def test_the_generation_tag_of_transformers_templates_renders(tmp_path):
    """`{% generation %}` (transformers' assistant-mask tag) was "unknown tag" in the server's Jinja environment: a
    model whose template has it failed every chat request; it now renders its body, as in transformers."""
    from hybridmoe.server.templates import render_chat

    source = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}<a>{{ m['content'] }}</a>"
              "{% endgeneration %}{% else %}<u>{{ m['content'] }}</u>{% endif %}{% endfor %}")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert render_chat(source, msgs, add_generation_prompt=False, continue_final_message=False,
                       variables={}) == "<u>hi</u><a>yo</a>"
    prepare(EngineArgs.from_kwargs(model_path=str(_demo(tmp_path / "m", chat_template=source)), device="cpu"))


def test_the_chat_template_flag_is_compiled(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(BROKEN)
    with pytest.raises(ConfigError) as e:
        EngineArgs.from_kwargs(chat_template=str(f))
    one_line(e, f"--chat-template {f}: not a valid Jinja template: unexpected '}}' (line 2 of the template)")
    f.write_bytes(b"{{")
    os.truncate(f, 1 << 40)
    with pytest.raises(ConfigError) as e:
        EngineArgs.from_kwargs(chat_template=str(f))
    one_line(e, f"--chat-template {f}: 1099511627776 bytes, more than a chat template can be")


def test_llm_refuses_a_broken_chat_template(tmp_path):
    model = _demo(tmp_path / "m", chat_template=BROKEN)
    with pytest.raises(CheckpointError) as e:
        LLM(model_path=str(model), device="cpu", progress=False)
    one_line(e, f"{model}/tokenizer_config.json: chat_template: not a valid Jinja template")


@pytest.mark.parametrize("which", ["serve", "generate"])
def test_serve_and_generate_refuse_a_broken_chat_template(which, tmp_path, capsys, never_load):
    model = _demo(tmp_path / "m", chat_template=BROKEN)
    argv = [which, "--device", "cpu", "--model", str(model)] + (["--port", "0"] if which == "serve" else [])
    _one_error_line(*_cli(argv, capsys), f"hybridmoe {which}",
                    f"{model}/tokenizer_config.json: chat_template: not a valid Jinja template")


def test_a_broken_chat_template_flag_exits_2(tmp_path, capsys, never_load):
    f = tmp_path / "t.jinja"
    f.write_text(BROKEN)
    argv = ["serve", "--device", "cpu", "--model", str(DEMO), "--port", "0", "--chat-template", str(f)]
    _one_error_line(*_cli(argv, capsys), "hybridmoe serve", f"--chat-template {f}: not a valid Jinja template")


def test_a_gguf_with_a_broken_chat_template_is_named(tmp_path, monkeypatch):
    """The template a GGUF carries (`tokenizer.chat_template`) is saved into the cached view directory; the
    error names the GGUF and the metadata key, not the cache file."""
    sys.path.insert(0, str(Path(__file__).parent / "gguf_io"))
    from gguf_files import write_model_gguf

    from tiny_models import make_tiny_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    ckpt = make_tiny_model("qwen3_moe", tmp_path / "hf", hidden_size=256, num_attention_heads=4,
                           moe_intermediate_size=256, mlp_only_layers=[], num_hidden_layers=2, vocab_size=4096)
    gguf = tmp_path / "tiny.gguf"
    write_model_gguf(ckpt, gguf, ("Q8_0",), chat_template=BROKEN)
    with pytest.raises(CheckpointError) as e:
        prepare(EngineArgs.from_kwargs(model_path=str(gguf), device="cpu"))
    one_line(e, f"{gguf}: tokenizer.chat_template: not a valid Jinja template: unexpected '}}' (line 2")


def test_generate_with_a_broken_chat_template_exits_2_as_a_process(tmp_path):
    model = _demo(tmp_path / "m", chat_template=BROKEN)
    r = _process(["generate", "--device", "cpu", "--model", str(model), "--chat", "--max-new-tokens", "1"])
    _one_error_line(r.returncode, r.stderr.splitlines(), "hybridmoe generate",
                    f"{model}/tokenizer_config.json: chat_template: not a valid Jinja template")
    assert r.stdout == ""


# ---- 4. generate needs a tokenizer: checked before the model loads ---------------------------------------
def test_generate_without_a_tokenizer_is_refused_up_front(tiny_model_dir, capsys, never_load):
    model = tiny_model_dir("qwen3_moe")  # config.json and weights only
    line = _one_error_line(*_cli(["generate", "--device", "cpu", "--model", str(model)], capsys), "hybridmoe generate",
                           f"{model}: no tokenizer files", "--tokenizer-path")
    assert "--prompt" in line


def test_generate_with_a_tokenizer_path_without_one_is_refused(tmp_path, capsys, never_load):
    empty = tmp_path / "tok"
    empty.mkdir()
    _one_error_line(*_cli(["generate", "--device", "cpu", "--model", str(DEMO), "--tokenizer-path", str(empty)],
                          capsys), "hybridmoe generate", f"--tokenizer-path {empty}: no tokenizer files")


def test_generate_with_skip_tokenizer_init_is_refused(capsys, never_load):
    _one_error_line(*_cli(["generate", "--device", "cpu", "--model", str(DEMO), "--skip-tokenizer-init"], capsys),
                    "hybridmoe generate", "--skip-tokenizer-init", "--prompt")


def test_generate_chat_without_a_chat_template_is_refused_up_front(tmp_path, capsys, never_load):
    model = _demo(tmp_path / "m", chat_template=None)
    _one_error_line(*_cli(["generate", "--device", "cpu", "--model", str(model), "--chat"], capsys),
                    "hybridmoe generate", f"--chat: {model} has no chat template", "--chat-template")


def test_serve_still_starts_a_model_without_a_tokenizer(tiny_model_dir):
    """Token ids in and out: the server's answer for text stays a 400 per request."""
    prepare(EngineArgs.from_kwargs(model_path=str(tiny_model_dir("qwen3_moe")), device="cpu"))


def test_generate_without_a_tokenizer_exits_2_as_a_process(tiny_model_dir):
    model = tiny_model_dir("qwen3_moe")
    r = _process(["generate", "--device", "cpu", "--model", str(model), "--max-new-tokens", "1"])
    _one_error_line(r.returncode, r.stderr.splitlines(), "hybridmoe generate", f"{model}: no tokenizer files")
    assert r.stdout == ""


def test_rope_tables_follow_the_context_length_not_the_model_maximum(tmp_path: Path) -> None:
    """The cos/sin tables cover --context-length, not max_position_embeddings: a model declaring 2^24 positions
    (the most model_check allows; real models declare up to ~10M) served at a 256-token context builds 256 rows,
    not 2^24 (2 GiB of tables for the demo's head dim, built at every start), and generates what the unmodified
    model generates."""
    big = _model_with_config(DEMO, tmp_path / "m", {"max_position_embeddings": 2**24})
    prompt = [[5, 17, 99, 3]]
    params = {"max_new_tokens": 12, "temperature": 0.0}
    outs = []
    for model in (big, DEMO):
        with LLM(str(model), device="cpu", context_length=256, max_total_tokens=1024) as llm:
            rotary = llm.engine.runner.model.model.rotary
            assert rotary.cos.shape[0] == rotary.sin.shape[0] == 256, rotary.cos.shape
            outs.append(llm.generate(input_ids=prompt, sampling_params=params)[0]["output_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 12


@pytest.mark.parametrize("overlap", [False, True])
def test_requests_at_the_context_edge_stay_inside_the_rope_tables(overlap: bool) -> None:
    """With the tables cut to the context length, requests that end exactly at it (a prompt one short of it,
    prompts whose new tokens fill it) run to their length, with the overlap scheduler's step ahead too: a
    position past the tables would raise here (the CPU path indexes them)."""
    with LLM(str(DEMO), device="cpu", context_length=40, max_total_tokens=512, enable_overlap_schedule=overlap,
             progress=False) as llm:
        assert llm.engine.runner.model.model.rotary.cos.shape[0] == 40
        outs = llm.generate(input_ids=[[5] * 30, [7] * 39, [9] * 10],
                            sampling_params={"max_new_tokens": 100, "temperature": 0.0, "ignore_eos": True})
    assert [len(o["output_ids"]) for o in outs] == [10, 1, 30]
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
