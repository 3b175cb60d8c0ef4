"""`hybridmoe serve --config FILE.yaml` (hybridmoe/config_file.py): the file's options, then the command line's
(which win); a bad file is one line naming it and the key (exit code 2)."""

from __future__ import annotations

import pytest

from hybridmoe.config import ConfigError
from hybridmoe.config_file import expand_config_file
from hybridmoe.launch_server import build_parser, serve_main


def _parse(tmp_path, text: str, *cli: str):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    parser = build_parser()
    return parser.parse_args(expand_config_file(["--config", str(path), *cli], parser))


def test_the_files_options_then_the_command_lines(tmp_path):
    ns = _parse(tmp_path, """
model_path: /models/qwen3
device: cpu
port: 31000
kt-num-gpu-experts: 8
random-seed: -1
enable-metrics: true
disable-radix-cache: false
allowed-origins: [https://a.example, https://b.example]
preferred_sampling_params: {temperature: 0.6, top_p: 0.95}
sampling-defaults: openai
""", "--port", "32000")
    assert ns.model_path == "/models/qwen3" and ns.device == "cpu" and ns.kt_num_gpu_experts == 8
    assert ns.random_seed == -1  # a value starting with "-" stays a value
    assert ns.enable_metrics is True and ns.disable_radix_cache is False
    assert ns.allowed_origins == ["https://a.example", "https://b.example"]
    assert ns.preferred_sampling_params == '{"temperature": 0.6, "top_p": 0.95}'
    assert ns.sampling_defaults == "openai" and ns.port == 32000  # the command line wins
    parser = build_parser()
    assert expand_config_file(["--port", "1"], parser) == ["--port", "1"]  # no --config: as given
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert expand_config_file([f"--config={empty}", "--port", "1"], parser) == ["--port", "1"]


@pytest.mark.parametrize("text, words", [
    ("[1, 2]", "expected a mapping of option names to values, got list"),
    ("colour: blue", "colour: not an option of hybridmoe serve"),
    ("config: other.yaml", "config: not an option"),
    ("enable-metrics: 1", "enable-metrics: a switch takes true or false, got 1"),
    ("port: [1, 2]", "port: takes one value, got a list"),
    ("port:", "port: no value"),
    ("allowed-origins: [[a]]", "a list inside a list"),
    ("1: x", "the key 1 is not an option name"),
    ("a: [unclosed", "not YAML"),
    ("a: &x [1]\nb: *x", "aliases (*name) are not allowed"),
    ("a: !!python/object:os.system x", "not YAML"),  # safe: no Python objects
    ("x: " + "y" * (1 << 20), "larger than 1024 KiB"),
    ("x: " + "[" * 100000 + "]" * 100000, "nested too deeply"),
])
def test_a_bad_file_is_one_line_naming_it(tmp_path, text, words):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        expand_config_file(["--config", str(path)], build_parser())
    message = str(e.value)
    assert message.startswith(f"--config {path}: ") and words in message and "\n" not in message, message


def test_config_flag_misuse_exits_2(tmp_path, capsys):
    for argv, words in [(["--config"], "expected a YAML file after it"),
                        (["--config", "a.yaml", "--config", "b.yaml"], "given more than once"),
                        (["--config", str(tmp_path / "missing.yaml")], "cannot be read: No such file")]:
        with pytest.raises(SystemExit) as e:
            serve_main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    path = tmp_path / "refused.yaml"
    path.write_text("tp-size: 2\n")  # an SGLang option refused as on the command line
    assert serve_main(["--config", str(path)]) == 2
    assert "--tp-size" in capsys.readouterr().err
