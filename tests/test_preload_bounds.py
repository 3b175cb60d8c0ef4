"""Buffers sized by flags alone are bounded or refused before the model loads (one line naming the flag), and the
`hybridmoe bench` commands' flag errors are one line each, before anything is started or reached.

No model is loaded: the checks run on the demo model's config (its modules on the meta device), against a
described machine (sizing.Machine) where the answer depends on one."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from hybridmoe.config import DEMO_MODEL_PATH, ConfigError, EngineArgs
from hybridmoe.engine.future import FutureTokens, placeholder
from hybridmoe.lora.adapter import LoRAAdapterError

GiB = 1 << 30
INT_MAX = 2**31 - 1
CPU = ("cpu", None, 16 * GiB, 4)  # --device cpu: float32, 16 GiB available (sizing.Machine's fields)
H100 = ("cuda", 80 * GiB, 500 * GiB, 2)  # a GPU, bf16


@pytest.fixture(scope="module")
def demo():
    from hybridmoe.model_check import load_checked_config

    return load_checked_config(DEMO_MODEL_PATH, False)  # (hf config, arch spec)


def _check(demo, machine: tuple, **flags) -> None:
    from hybridmoe.sizing import Machine, check_preload_bounds

    cfg, spec = demo
    check_preload_bounds(EngineArgs.from_kwargs(**flags), cfg, spec, Machine(*machine))


def _refusal(demo, machine: tuple, **flags) -> str:
    with pytest.raises(ConfigError) as e:
        _check(demo, machine, **flags)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def _accepts(demo, machine: tuple, **flags) -> None:
    _check(demo, machine, **flags)


# ---- 1. --max-running-requests and the buffers it sizes ------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_future_ring_grows_with_the_rows_a_step_samples(device):
    """The overlap ring is sized by the rows steps really sample, not by --max-running-requests (which made it
    a 51 GB torch.zeros after the load at 2147483647); growing keeps the slots of the steps in flight (on CUDA
    also the pinned host copies: a copy in flight keeps its old buffer)."""
    from hybridmoe.engine.future import INITIAL_ROWS

    f = FutureTokens(max_rows=10**6, device=torch.device(device))
    assert f.ring.numel() == 3 * INITIAL_ROWS + 2
    prev_slot, prev = f.publish(torch.arange(5, device=device))[0], torch.arange(5, device=device)
    pending = f.publish(torch.arange(7, 10, device=device))[1]  # read only after the ring has grown twice
    for n in (300, 301, 2000, 7):  # grows at 300 (to 512 rows) and 2000; never onto the previous step's slots
        ids = torch.arange(1000, 1000 + n, device=device)
        slot, host = f.publish(ids)
        assert host.read() == ids.tolist()
        assert slot >= prev_slot + len(prev) or slot + n <= prev_slot
        held = [placeholder(prev_slot + i) for i in range(len(prev))]  # the step before, read after the growth
        assert f.resolve(torch.tensor(held), held).tolist() == prev.tolist()
        mine = [placeholder(slot + i) for i in range(n)]
        assert f.resolve(torch.tensor(mine), mine).tolist() == ids.tolist()
        prev_slot, prev = slot, ids
    assert f.rows == 2000 and f.ring.numel() == 3 * 2000 + 2
    assert pending.read() == [7, 8, 9]
    with pytest.raises(ValueError):
        f.publish(torch.zeros(10**6 + 1, dtype=torch.int64, device=device))


def test_max_running_requests_alone_is_accepted(demo):
    """Nothing is allocated for it up front any more (the ring grows; a step's rows each hold KV tokens)."""
    _accepts(demo, CPU, device="cpu", max_running_requests=INT_MAX)
    _accepts(demo, H100, max_running_requests=INT_MAX)  # the decode graphs: min(it, --cuda-graph-max-bs 64)


def test_cuda_graph_batch_refused_naming_the_flag(demo):
    msg = _refusal(demo, H100, cuda_graph_max_bs=INT_MAX, max_running_requests=INT_MAX)
    assert msg.startswith(f"--cuda-graph-max-bs {INT_MAX}: the decode CUDA graphs' buffers")
    assert "GiB of GPU memory, the GPU has 80.0 GiB" in msg
    msg = _refusal(demo, H100, cuda_graph_max_bs=INT_MAX, max_running_requests=10**8)
    assert msg.startswith("--max-running-requests 100000000 (the largest decode CUDA graph batch")
    _accepts(demo, H100, cuda_graph_max_bs=INT_MAX, max_running_requests=INT_MAX, disable_cuda_graph=True)
    _accepts(demo, CPU, device="cpu", cuda_graph_max_bs=INT_MAX, max_running_requests=INT_MAX)  # no graphs
    _accepts(demo, H100, cuda_graph_max_bs=512, max_running_requests=512)


@pytest.mark.gpu
def test_the_machine_is_read_from_the_gpu_in_use(demo):
    """Machine.of on a real GPU (the other tests describe one): its total memory, and the graph check against it."""
    from hybridmoe.sizing import Machine, check_preload_bounds

    cfg, spec = demo
    args = EngineArgs.from_kwargs(device="cuda", cuda_graph_max_bs=INT_MAX, max_running_requests=INT_MAX)
    m = Machine.of(args, cfg)
    total = torch.cuda.get_device_properties(0).total_memory
    assert m.device == "cuda" and m.gpu_bytes == total and m.dtype_bytes == 2
    with pytest.raises(ConfigError, match=f"GiB of GPU memory, the GPU has {total / GiB:.1f} GiB"):
        check_preload_bounds(args, cfg, spec)
    check_preload_bounds(EngineArgs.from_kwargs(device="cuda"), cfg, spec)  # the defaults fit any GPU


def test_hybrid_plan_rows_refused_naming_the_flag(demo):
    """The hybrid memory plan's per-row items: was "the plan needs 4096.0 GiB of host memory for CPU experts ...
    use more GPU experts or a smaller --kt-method"."""
    msg = _refusal(demo, CPU, device="cpu", kt_num_gpu_experts=2, max_running_requests=INT_MAX)
    assert msg.startswith(f"--max-running-requests {INT_MAX}: the CPU experts' pinned input/output buffers")
    assert "GiB of host memory, 16.0 GiB are available" in msg
    msg = _refusal(demo, H100, kt_num_gpu_experts=2, max_running_requests=10**6, disable_cuda_graph=True)
    assert msg.startswith("--max-running-requests 1000000: the activations and graphs") and "GPU memory" in msg
    _accepts(demo, CPU, device="cpu", kt_num_gpu_experts=2, max_running_requests=1024)


# ---- 2. the LoRA slot buffers ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["max_lora_rank", "max_loras_per_batch"])
def test_lora_slot_buffers_refused_before_the_load(demo, flag):
    name = "--" + flag.replace("_", "-")
    msg = _refusal(demo, CPU, device="cpu", enable_lora=True, **{flag: INT_MAX})
    assert msg.startswith(f"{name} {INT_MAX}: the LoRA slot buffers (") and "16.0 GiB are available" in msg
    msg = _refusal(demo, H100, enable_lora=True, **{flag: INT_MAX})
    assert msg.startswith(f"{name} {INT_MAX}:") and "GiB of GPU memory, the GPU has 80.0 GiB" in msg
    _accepts(demo, CPU, device="cpu", enable_lora=True, **{flag: 64})


def _hand_adapter():
    """tests/lora/lora_fixtures.py hand_adapter (that directory is not on the path here)."""
    spec = importlib.util.spec_from_file_location("lora_fixtures", Path(__file__).parent / "lora" / "lora_fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.hand_adapter


def test_slot_plan_equals_the_built_buffers(demo, tmp_path):
    """lora/plan.py slot_buffers: the wrapped linears' bytes equal what build_manager allocates (on the meta
    device: nothing is allocated), and an expert adapter adds the experts' slots, the CPU share on the host."""
    from hybridmoe.lora.plan import expert_slot_bytes, meta_model, slot_buffers
    from hybridmoe.lora.setup import build_manager

    cfg, spec = demo
    hand_adapter = _hand_adapter()
    attn = hand_adapter(cfg, tmp_path / "attn", seed=1, r=4, with_experts=False)
    for flags in ({"lora_target_modules": ["q_proj", "o_proj"], "max_lora_rank": 16, "max_loras_per_batch": 3},
                  {}, {"lora_paths": [str(attn)]}):
        args = EngineArgs.from_kwargs(device="cpu", enable_lora=True, **flags)
        mgr = build_manager(args, meta_model(cfg, spec), torch.device("meta"), torch.float32, 0)
        planned = slot_buffers(args, cfg, spec, "cpu", 4)
        assert (planned.device, planned.host) == mgr.nbytes() and planned.linears == len(mgr.wrapped), flags
    experts = hand_adapter(cfg, tmp_path / "ex", seed=2, r=4)
    args = EngineArgs.from_kwargs(device="cpu", lora_paths=[str(experts)], kt_num_gpu_experts=2, kt_method="BF16")
    with_experts = slot_buffers(args, cfg, spec, "cpu", 4)
    gpu_mask = torch.tensor([True] * 2 + [False] * (spec.num_experts - 2))
    gpu, host = expert_slot_bytes(args, cfg.hidden_size, spec.moe_intermediate,
                                  {layer: gpu_mask for layer in spec.moe_layers}, "BF16", 128, 4)
    linears = slot_buffers(EngineArgs.from_kwargs(device="cpu", lora_paths=[str(attn)]), cfg, spec, "cpu", 4)
    assert host > 0 and with_experts.host == host and with_experts.device == linears.device + gpu
    assert with_experts.expert_layers == len(spec.moe_layers)


def test_lora_graph_index_only_where_graphs_replay(demo):
    """The CUDA-graph slot index (min(--cuda-graph-max-bs, --max-running-requests) entries) is not allocated
    where no graph replays: it was gigabytes on the CPU when both flags were huge."""
    from hybridmoe.lora.plan import meta_model
    from hybridmoe.lora.setup import build_manager

    cfg, spec = demo
    args = EngineArgs.from_kwargs(device="cpu", enable_lora=True)
    mgr = build_manager(args, meta_model(cfg, spec), torch.device("meta"), torch.float32, 10**6)
    assert mgr.batch.graph_index.numel() == 1


# ---- 3. --lora-target-modules ----------------------------------------------------------------------------------------
def test_unknown_target_module_refused(demo):
    """A name the model has no linear of matched nothing: LoRA on fewer modules than asked, silently."""
    msg = _refusal(demo, CPU, device="cpu", enable_lora=True, lora_target_modules=["q_proj", "bogus"])
    assert msg.startswith("--lora-target-modules bogus: no LoRA-targetable linear of this model (qwen3_moe)")
    assert "q_proj, k_proj, v_proj, qkv_proj, o_proj, or all" in msg
    msg = _refusal(demo, CPU, device="cpu", enable_lora=True, lora_target_modules=["gate_proj"])  # experts only
    assert msg.startswith("--lora-target-modules gate_proj:")
    for ok in (["all"], ["q_proj", "o_proj"], ["qkv_proj"]):
        _accepts(demo, CPU, device="cpu", enable_lora=True, lora_target_modules=ok)


def test_unknown_target_module_refused_where_the_manager_is_built(demo):
    """Also when the runner builds its manager (the in-process API, or a startup without the check)."""
    from hybridmoe.lora.plan import meta_model
    from hybridmoe.lora.setup import build_manager

    cfg, spec = demo
    args = EngineArgs.from_kwargs(device="cpu", enable_lora=True, lora_target_modules=["bogus"])
    with pytest.raises(LoRAAdapterError, match=r"^--lora-target-modules bogus: "):
        build_manager(args, meta_model(cfg, spec), torch.device("meta"), torch.float32, 0)


# ---- 4. hybridmoe bench ----------------------------------------------------------------------------------------------
def _one_line(capsys, prog: str, flag: str) -> None:
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: ") and flag in err[0], err


@pytest.mark.parametrize("argv", [[], ["bogus"]])
def test_bench_without_a_sub_command_is_one_line(capsys, argv):
    from hybridmoe.bench import bench_main

    assert bench_main(argv) == 2
    _one_line(capsys, "hybridmoe bench", "one-batch, serving or shape")


@pytest.mark.parametrize(("argv", "flag"), [
    (["qwen3-30b-a3b", "OUT", "--layers", "-1"], "--layers"),
    (["qwen3-30b-a3b", "/dev/null"], "/dev/null"),
    (["qwen3-30b-a3b", "FILE"], "is not a directory"),
    (["nope", "OUT"], "invalid choice"),
    ([], "required"),
])
def test_bench_shape_errors_are_one_line(capsys, tmp_path, argv, flag):
    from hybridmoe.bench.shape_cli import main

    (tmp_path / "FILE").write_text("")
    argv = [str(tmp_path / a) if a in ("OUT", "FILE") else a for a in argv]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    _one_line(capsys, "hybridmoe bench shape", flag)
    assert not (tmp_path / "OUT").exists()


@pytest.mark.parametrize(("argv", "flag"), [
    (["--server-args", "--port 'x"], "--server-args"),
    (["--concurrency", "4", "0"], "--concurrency"),
    (["--request-rate", "nan"], "--request-rate"),
    (["--request-rate", "0"], "--request-rate"),
    (["--range-ratio", "-3"], "--range-ratio"),
    (["--range-ratio", "nan"], "--range-ratio"),
    (["--input-len", "0"], "--input-len"),
    (["--concurrency", str(10**9)], "--concurrency 1000000000"),
    (["--out", "/nonexistent-dir/r.json"], "--out"),
    (["--concurrency", "x"], "--concurrency"),
])
def test_bench_serving_flags_checked_before_connecting(capsys, monkeypatch, argv, flag):
    import httpx

    from hybridmoe.bench import serving

    def no_network(*a, **k):
        raise AssertionError("reached the network before the flags were checked")

    monkeypatch.setattr(httpx, "get", no_network)
    monkeypatch.setattr(serving, "start_server", no_network)
    with pytest.raises(SystemExit) as e:
        serving.main(["--url", "http://127.0.0.1:9", *argv])
    assert e.value.code == 2
    _one_line(capsys, "hybridmoe bench serving", flag)


def test_bench_serving_accepts_inf_rate():
    from hybridmoe.bench.serving import build_parser, check_flags

    a = build_parser().parse_args(["--request-rate", "inf", "--range-ratio", "0", "--server-args", "--port 'x'"])
    assert math.isinf(a.request_rate) and check_flags(a) is None


def test_slot_buffers_checked_where_the_manager_is_built(demo, monkeypatch):
    """build_manager checks the linears' slots against the memory free then, before allocating them (the LLM
    API, or a startup without the check): a huge --max-lora-rank was the allocator's RuntimeError."""
    from hybridmoe.lora.plan import meta_model
    from hybridmoe.lora.setup import build_manager
    from hybridmoe.moe import memory_plan

    cfg, spec = demo
    monkeypatch.setattr(memory_plan, "host_available_bytes", lambda: 1 << 20)  # 1 MiB free: a few MB do not fit
    args = EngineArgs.from_kwargs(device="cpu", enable_lora=True, max_lora_rank=256)
    with pytest.raises(LoRAAdapterError, match=r"^--max-lora-rank 256: the LoRA slot buffers \(8 slots of rank 256 "
                                                r"on 8 linears\) need [0-9.]+ GiB of host memory, [0-9.]+ GiB are free$"):
        build_manager(args, meta_model(cfg, spec), torch.device("cpu"), torch.float32, 0)
