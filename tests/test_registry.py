"""hybridmoe.registry: lazy name -> object registries, and the three built-in ones using it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from hybridmoe.registry import FactoryLoadError, Registry, UnknownNameError

ROOT = Path(__file__).resolve().parents[1]


def _module(tmp_path: Path, monkeypatch, body: str) -> str:
    """A fresh importable module holding `body` (a unique name, so no earlier import is reused)."""
    name = f"regmod_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_register_does_not_import_and_get_imports_once(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, """
        LOADS = []
        LOADS.append(1)
        def make():
            return "made"
        class Outer:
            class Inner:
                pass
    """)
    reg: Registry = Registry("test thing")
    reg.register("a", f"{mod}:make")
    reg.register("nested", f"{mod}:Outer.Inner")
    assert mod not in sys.modules and not reg.is_loaded("a")
    assert reg.names() == ["a", "nested"] and "a" in reg and len(reg) == 2
    assert mod not in sys.modules  # listing names imports nothing either
    make = reg.get("a")
    assert make() == "made" and reg.is_loaded("a")
    assert reg.get("a") is make and reg["a"] is make
    assert reg.get("nested") is sys.modules[mod].Outer.Inner
    assert sys.modules[mod].LOADS == [1]


def test_unknown_name_lists_the_registered_ones():
    reg: Registry = Registry("widget backend")
    names = sorted(f"w{uuid.uuid4().hex[:6]}" for _ in range(3))
    for n in names:
        reg.register(n, "os.path:join")
    with pytest.raises(UnknownNameError) as err:
        reg.get("nope")
    msg = str(err.value)
    assert "widget backend" in msg and "'nope'" in msg and all(n in msg for n in names)
    assert isinstance(err.value, ValueError)  # callers that caught the old ValueError still do
    with pytest.raises(UnknownNameError, match=r"available: \(none\)"):
        Registry("empty").get("x")


def test_factory_import_failure_is_reported_with_the_name(tmp_path, monkeypatch):
    missing = f"missing_dep_{uuid.uuid4().hex[:8]}"
    mod = _module(tmp_path, monkeypatch, f"import {missing}\ndef make():\n    pass\n")
    ok = _module(tmp_path, monkeypatch, "def make():\n    return 1\n")
    reg: Registry = Registry("accelerator")
    reg.register("fancy", f"{mod}:make")
    reg.register("renamed", f"{ok}:old_name")
    reg.register("plain", f"{ok}:make")
    with pytest.raises(FactoryLoadError) as err:
        reg.get("fancy")
    msg = str(err.value)
    assert "accelerator 'fancy' is unavailable" in msg and missing in msg
    assert isinstance(err.value, ImportError) and isinstance(err.value.__cause__, ImportError)
    with pytest.raises(FactoryLoadError, match="'renamed'.*old_name"):
        reg.get("renamed")
    assert not reg.is_loaded("fancy")
    assert reg.available() == ["plain"]  # the broken ones are skipped, the rest still work
    assert reg.get("plain")() == 1


def test_register_validates_and_refuses_a_different_duplicate():
    reg: Registry = Registry("thing")
    with pytest.raises(ValueError, match="not 'module:attr'"):
        reg.register("x", "no_colon_here")
    with pytest.raises(ValueError, match="empty name"):
        reg.register("", "os:sep")
    reg.register("join", "os.path:join")
    reg.register("join", "os.path:join")  # the same target again is fine
    with pytest.raises(ValueError, match="already registered as os.path:join"):
        reg.register("join", "os.path:split")
    with pytest.raises(ValueError, match="already registered"):
        reg.register("join", len)


def test_a_module_registering_itself_matches_its_lazy_entry(tmp_path, monkeypatch):
    """The decorator form inside the target module (old style) agrees with the package's string."""
    reg: Registry = Registry("self-registering")
    monkeypatch.setattr(sys.modules[__name__], "REG", reg, raising=False)
    mod = _module(tmp_path, monkeypatch, f"""
        from {__name__} import REG
        @REG.decorator("me")
        def make():
            return 7
    """)
    reg.register("me", f"{mod}:make")
    assert reg.get("me")() == 7
    reg.register("me", f"{mod}:make")  # the string naming the loaded object: still the same


def test_decorator_registers_directly():
    reg: Registry = Registry("thing")

    @reg.decorator("f")
    def f() -> int:
        return 3

    assert reg.is_loaded("f") and reg.get("f") is f


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})


def test_builtin_packages_register_without_importing_implementations():
    """Importing the interfaces (and their packages) loads no backend nor architecture module."""
    r = _python("""
        import sys
        from hybridmoe.layers.attention import ATTENTION_BACKENDS, get_attention_backend
        from hybridmoe.moe.experts import EXPERTS_BACKENDS, create_experts
        from hybridmoe.models.registry import ARCHITECTURES, arch_spec
        impl = ["hybridmoe.layers.attention.torch_backend", "hybridmoe.layers.attention.triton_backend",
                "hybridmoe.moe.torch_experts", "hybridmoe.moe.triton_experts", "hybridmoe.moe.cpu_experts",
                "hybridmoe.moe.hybrid", "hybridmoe.models.deepseek", "hybridmoe.models.mixtral",
                "hybridmoe.models.qwen2_moe", "hybridmoe.models.qwen3_moe", "triton"]
        print("loaded", [m for m in impl if m in sys.modules])
        print("names", ATTENTION_BACKENDS.names(), EXPERTS_BACKENDS.names(), ARCHITECTURES.names())
    """)
    assert r.returncode == 0, r.stderr
    assert "loaded []" in r.stdout, r.stdout
    assert ("names ['torch', 'triton'] ['cpu', 'hybrid', 'torch', 'triton'] "
            "['DeepseekV2ForCausalLM', 'DeepseekV3ForCausalLM', 'MixtralForCausalLM', 'Qwen2MoeForCausalLM', "
            "'Qwen3MoeForCausalLM']") in r.stdout


def test_missing_triton_makes_only_the_triton_backends_unavailable():
    r = _python("""
        import sys
        sys.modules["triton"] = None  # as if Triton were not installed: `import triton` fails
        from hybridmoe.layers.attention import get_attention_backend
        from hybridmoe.moe.experts import available_experts_backends, create_experts
        from hybridmoe.registry import FactoryLoadError
        print("torch attention", type(get_attention_backend("torch")).__name__)
        print("experts", available_experts_backends())
        for what, call in (("attention", lambda: get_attention_backend("triton")),
                           ("experts", lambda: create_experts("triton", None, 0))):
            try:
                call()
            except FactoryLoadError as e:
                print(what, "error:", e)
    """)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "torch attention TorchAttentionBackend" in out
    assert "experts ['cpu', 'hybrid', 'torch']" in out
    assert "attention error: attention backend 'triton' is unavailable" in out and "triton" in out
    assert "experts error: MoE experts backend 'triton' is unavailable" in out


def test_builtin_targets_resolve():
    """Every built-in "module:attr" names a real object (catches a renamed factory)."""
    pytest.importorskip("triton")
    from hybridmoe.layers.attention import ATTENTION_BACKENDS
    from hybridmoe.models.registry import ARCHITECTURES
    from hybridmoe.moe.experts import EXPERTS_BACKENDS

    for reg in (ATTENTION_BACKENDS, EXPERTS_BACKENDS, ARCHITECTURES):
        for name in reg.names():
            assert callable(reg.get(name)), (reg.kind, name)


def test_public_functions_keep_working():
    import torch

    from hybridmoe.layers.attention import get_attention_backend
    from hybridmoe.models.registry import arch_spec, supported_architectures
    from hybridmoe.moe.experts import ExpertWeights, create_experts

    assert get_attention_backend("torch").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend 'flash'; available: torch, triton"):
        get_attention_backend("flash")
    e, i, h = 4, 8, 16
    w = ExpertWeights(torch.randn(e, 2 * i, h), torch.randn(e, h, i))
    experts = create_experts("torch", w, 0)
    x = torch.randn(3, h)
    ids = torch.randint(0, e, (3, 2))
    out = experts.forward(x, ids, torch.rand(3, 2))
    assert out.shape == (3, h)
    with pytest.raises(ValueError, match="unknown MoE experts backend 'gpu'.*cpu, hybrid, torch, triton"):
        create_experts("gpu", w, 0)
    assert "Qwen3MoeForCausalLM" in supported_architectures()

    class Cfg:
        architectures = ["LlamaForCausalLM"]

    with pytest.raises(ValueError, match="not supported; supported architectures: DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Mixtral"):
        arch_spec(Cfg())
