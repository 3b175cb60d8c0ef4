"""Load a Hugging Face model directory: config, safetensors (single file or sharded), into a
MoECausalLM; routed experts are stacked per layer and handed to the chosen MoE backend.

Errors name the file and tensor at fault; a progress bar counts layers.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from hybridmoe.cpu import hugepages
from hybridmoe.layers.fp8_kernels import fp8_gemm_supported, kernel_block_ok
from hybridmoe.models.base import ArchSpec, MoECausalLM
from hybridmoe.models.registry import arch_spec
from hybridmoe.moe.experts import ExpertWeights, MoEExperts
from hybridmoe.weights.errors import CheckpointError
from hybridmoe.weights.fp8 import FP8_DTYPES
from hybridmoe.weights.fp8_loading import (
    Fp8DummyReader,
    Fp8Reader,
    fp8_block_of,
    fp8_checkpoint_parts,
    mtp_tensor_count,
    swap_fp8_linears,
)
from hybridmoe.weights.progress import LoadProgress, tensor_bytes
from hybridmoe.weights.readahead import LayerReadahead, TensorSpan, read_into, tensor_spans
from hybridmoe.weights.shards import INDEX, read_index

log = logging.getLogger(__name__)


def load_hf_config(model_path: str, trust_remote_code: bool = False):
    """The transformers config of a local model directory."""
    from hybridmoe.models.hf_config import load_config

    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        return load_config(path, trust_remote_code)  # models/hf_config.py: transformers' class, aliases
    except Exception as e:  # transformers raises many types; name the file
        raise CheckpointError(f"{path / 'config.json'}: cannot be read: {e}") from e


def _open(path: Path):
    """safe_open, with an error naming the file (safetensors' own does not)."""
    try:
        return safe_open(str(path), "pt")
    except Exception as e:  # SafetensorError, OSError: a truncated or damaged file
        raise CheckpointError(f"{path}: not a readable safetensors file: {' '.join(str(e).split())}") from e


_FLOAT_CODES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
                "F8_E5M2": torch.float8_e5m2}  # safetensors header dtype codes


class SafetensorsIndex:
    """Which file holds each tensor of a checkpoint; opens files lazily, once each."""

    def __init__(self, model_path: str) -> None:
        root = Path(model_path)
        index = root / INDEX
        self.file_of: dict[str, Path] = {}
        if index.is_file():
            for name, fname in read_index(index).items():
                self.file_of[name] = root / fname
            for f in set(self.file_of.values()):
                if not f.is_file():
                    raise CheckpointError(f"{index} lists {f.name}, which is missing")
        else:
            files = sorted(root.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{root}: no *.safetensors files (other weight formats are not supported)")
            for f in files:
                with _open(f) as h:
                    for name in h.keys():
                        self.file_of[name] = f
        self._handles: dict[Path, object] = {}
        self._spans: dict[Path, dict[str, TensorSpan]] = {}
        self._fds: dict[Path, int] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def _handle(self, name: str):
        f = self.file_of.get(name)
        if f is None:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
        h = self._handles.get(f)
        if h is None:
            h = self._handles[f] = _open(f)
        return f, h

    def dtype_of(self, name: str) -> torch.dtype | None:
        """The stored dtype of tensor `name`, from the file header (no data read); None for a
        non-float one (refused by `get`)."""
        return _FLOAT_CODES.get(self._handle(name)[1].get_slice(name).get_dtype())

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor `name`, from the file header."""
        return tuple(self._handle(name)[1].get_slice(name).get_shape())

    def get(self, name: str, shape: tuple[int, ...] | None = None, allow_fp8: bool = False) -> torch.Tensor:
        """Tensor `name`, checked: its shape (when given) and a float dtype (fp8 only with allow_fp8:
        the fp8 reader, weights/fp8_loading.py, which pairs it with its scales)."""
        f, h = self._handle(name)
        try:
            t = h.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{f.name}: tensor {name!r} cannot be read: {e}") from e
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{f.name}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if t.dtype in FP8_DTYPES and not allow_fp8:
            raise CheckpointError(f"{f.name}: tensor {name!r} has dtype {t.dtype}, but config.json has no "
                                  "quantization_config with quant_method 'fp8' and a weight_block_size")
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16) + FP8_DTYPES:
            raise CheckpointError(f"{f.name}: tensor {name!r} has dtype {t.dtype}; bf16, fp16 or fp32 expected")
        return t

    def fill(self, name: str, dst: torch.Tensor) -> None:
        """Copy tensor `name` into dst, checking its shape. A contiguous CPU dst of the stored dtype
        and shape is read straight from the file (readahead.read_into); anything else through get()."""
        span = self._span(name) if dst.device.type == "cpu" and dst.is_contiguous() else None
        if (span is not None and span.shape == tuple(dst.shape) and _FLOAT_CODES.get(span.dtype) == dst.dtype
                and dst.dtype not in FP8_DTYPES and span.end - span.start == dst.nbytes):
            f = self.file_of[name]
            try:
                fd = self._fds.get(f)
                if fd is None:
                    fd = self._fds[f] = os.open(f, os.O_RDONLY)
                read_into(fd, span.start, span.end, dst)
            except (OSError, EOFError) as e:
                raise CheckpointError(f"{f.name}: tensor {name!r} cannot be read: {e}") from e
            return
        dst.copy_(self.get(name, tuple(dst.shape)))

    def _span(self, name: str) -> TensorSpan | None:
        """Where tensor `name` lies in its file (header parsed once per file); None when the file's
        header is not understood here (get() reports it)."""
        f = self.file_of.get(name)
        if f is None:
            return None
        spans = self._spans.get(f)
        if spans is None:
            try:
                self._handle(name)  # safetensors validates the file first (errors name it)
                spans = self._spans[f] = tensor_spans(f)
            except (OSError, ValueError, KeyError, TypeError):
                spans = self._spans[f] = {}
        return spans.get(name)

    def close(self) -> None:
        """Close the file descriptors fill() opened."""
        fds = getattr(self, "_fds", {})  # (__init__ may have failed before setting it)
        for fd in fds.values():
            os.close(fd)
        fds.clear()

    def __del__(self) -> None:
        self.close()


def checkpoint_index(model_path: str):
    """The tensors of a model directory: its safetensors, or the GGUF a `--model FILE.gguf` view
    directory stands for (gguf/view.py; dequantized on read, gguf/weights.py)."""
    from hybridmoe.gguf.view import gguf_source

    src = gguf_source(model_path)
    if src is None:
        return SafetensorsIndex(model_path)
    from hybridmoe.gguf.weights import open_weights

    return open_weights(src)


class DummyWeights:
    """Random weights generated in place on the target device (`--load-format dummy`), for
    benchmarks of full-size shapes without a checkpoint on disk."""

    def __init__(self, std: float = 0.02, seed: int = 0) -> None:
        self.std = std
        self.seed = seed

    def __contains__(self, name: str) -> bool:
        return True

    def fill(self, name: str, dst: torch.Tensor) -> None:
        """The same values for the same name, seed and device in every process (a generator per tensor:
        the global one left them to the process, so two runs of a benchmark measured two models)."""
        if "norm" in name:
            dst.fill_(1.0)
            return
        seed = (self.seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)
        if dst.device.type == "cpu" and torch.cuda.is_available():
            # host-side tensors (CPU experts) are drawn on the GPU: ~100x faster than on the CPU
            g = torch.Generator(device="cuda").manual_seed(seed)
            dst.copy_(torch.empty(dst.shape, dtype=dst.dtype, device="cuda").normal_(0.0, self.std, generator=g))
        else:
            dst.normal_(0.0, self.std, generator=torch.Generator(device=dst.device).manual_seed(seed))


ExpertsBuilder = Callable[[ExpertWeights, int], MoEExperts]


def _free_bytes(device: torch.device) -> int | None:
    """Memory a new allocation on `device` may take: MemAvailable for the CPU, the free memory of a GPU."""
    if device.type == "cuda":
        try:
            return torch.cuda.mem_get_info(device)[0]
        except Exception:  # a driver that cannot say: the allocator will
            return None
    from hybridmoe.moe.memory_plan import host_available_bytes

    return host_available_bytes()


def check_room(model: torch.nn.Module, device: torch.device, config_file: str) -> None:
    """A model (still on the meta device) whose parameters and buffers cannot fit the free memory of `device`:
    one line naming the config and its sizes, before any allocation (else the allocator's own error, with a
    byte count and no name, after minutes of loading)."""
    need = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    free = _free_bytes(device)
    if free is None or need <= free:
        return
    cfg = getattr(model, "config", None)
    sizes = ", ".join(f"{k} {getattr(cfg, k)}" for k in ("hidden_size", "vocab_size", "num_hidden_layers")
                      if isinstance(getattr(cfg, k, None), int))
    gib = 1 << 30
    raise CheckpointError(f"{config_file}: the model's weights on {device.type} need {need / gib:.1f} GiB "
                          f"({sizes}), {free / gib:.1f} GiB are free there")


def load_model(
    model_path: str,
    config,
    dtype: torch.dtype,
    device: torch.device,
    make_experts: ExpertsBuilder,
    expert_device: Callable[[int], torch.device] | None = None,
    max_position: int | None = None,
    progress: bool = True,
    load_format: str = "auto",
    read_experts: bool = True,
    spec: ArchSpec | None = None,
    fp8_dequantize: bool = False,
) -> MoECausalLM:
    """Build the model on `device` in `dtype` and fill it from the checkpoint.

    make_experts(weights, layer_idx) creates each MoE layer's experts backend; expert_device(layer)
    says where that layer's stacked expert tensors are assembled (default: `device`). With
    read_experts=False the routed experts are not read (the backend has them from elsewhere, e.g.
    `--kt-weight-path`) and make_experts gets None. `spec`: the architecture (ModelConfig.spec),
    resolved from `config` when not given.

    Block-scaled fp8 checkpoints (weights/fp8_loading.py): linears stay fp8 (Fp8Linear) on GPUs with
    FP8, are dequantized to `dtype` elsewhere or with fp8_dequantize; routed experts come in the fp8
    ExpertWeights form unless fp8_dequantize. Layers past num_hidden_layers (MTP) are not read.
    """
    spec = spec or arch_spec(config, f"{model_path}/config.json")
    dummy = load_format == "dummy"
    index = DummyWeights() if dummy else checkpoint_index(model_path)
    try:
        block = fp8_block_of(config)
    except ValueError as e:
        raise CheckpointError(f"{model_path}/{e}") from e
    reader = index
    keep_fp8 = False
    if block is not None:
        reader = Fp8DummyReader(index, block) if dummy else Fp8Reader(index, block, CheckpointError)
        keep_fp8 = not fp8_dequantize and fp8_gemm_supported(device) and kernel_block_ok(block)
    if not dummy:
        _note_mtp_layers(list(index.file_of), config)
    max_position = max_position or getattr(config, "max_position_embeddings", 4096)
    with torch.device("meta"):
        model = MoECausalLM(config, spec, max_position)
        model.to(dtype)  # on meta: no memory is allocated in the wrong dtype first
    if keep_fp8:
        swapped, dequantized = swap_fp8_linears(model, reader, block, dtype, model.checkpoint_parts)
    check_room(model, device, f"{model_path}/config.json")
    model = model.to_empty(device=device)
    model.model.rotary.build(device)
    if block is not None:
        experts_fp8 = not fp8_dequantize and read_experts
        if keep_fp8:
            what = f"{swapped} linear layers kept in FP8 (Triton W8A8 block GEMM)"
            if dequantized:
                what += f", {dequantized} dequantized to {dtype} (fused parts not aligned to the {block[0]}-row blocks)"
        else:
            why = ("--fp8-dequantize" if fp8_dequantize else f"no FP8 GEMM on {_device_name(device)}"
                   if not fp8_gemm_supported(device) else f"block {list(block)} does not suit the kernel")
            what = f"fp8 linears dequantized to {dtype} at load ({why})"
        log.info("FP8 block-scaled checkpoint (weight_block_size %s): %s; routed experts %s", list(block), what,
                 "in FP8 (codes + block scales)" if experts_fp8 else f"dequantized to {dtype}")

    def parts(name: str, param: torch.Tensor) -> list[tuple[str, torch.Tensor, bool]]:
        if block is None:
            return [(src, dst, False) for src, dst in model.checkpoint_parts(name, param)]
        return fp8_checkpoint_parts(model, name, param, model.checkpoint_parts)

    def fill(name: str, param: torch.Tensor) -> None:
        for src, dst, is_scale in parts(name, param):
            if is_scale:
                reader.fill_scale(src, dst)
            else:
                reader.fill(src, dst)

    params = dict(model.named_parameters())
    by_layer: dict[int, list[str]] = {}
    top: list[str] = []
    for name in params:
        parts_ = name.split(".")
        (by_layer.setdefault(int(parts_[2]), []) if parts_[:2] == ["model", "layers"] else top).append(name)

    # routed experts from --kt-weight-path (read_experts False) are not read here: not read ahead either
    ahead = (LayerReadahead(index.file_of, skip=None if read_experts else ".experts.")
             if isinstance(index, SafetensorsIndex) else None)
    if ahead is not None:
        ahead.layer(0)  # read while the embeddings and the head are copied
    try:
        with torch.no_grad():
            for name in top:
                if name == "lm_head.weight" and name not in index and model.tie_word_embeddings:
                    reader.fill("model.embed_tokens.weight", params[name])
                else:
                    fill(name, params[name])
            expert_elt = 1 if block is not None and not fp8_dequantize else torch.finfo(dtype).bits // 8
            experts_total = (len(spec.moe_layers) * spec.num_experts * 3 * config.hidden_size * spec.moe_intermediate
                             * expert_elt if read_experts else 0)
            bar = LoadProgress(config.num_hidden_layers, sum(p.nbytes for p in params.values()) + experts_total, progress)
            bar.add_bytes(sum(params[name].nbytes for name in top))
            for i in bar.layers(config.num_hidden_layers):
                if ahead is not None and i + 1 < config.num_hidden_layers:  # (not the unread MTP layers)
                    ahead.layer(i + 1)  # the disk reads layer i + 1 while layer i is copied and packed
                for name in by_layer.get(i, []):
                    fill(name, params[name])
                    bar.add_bytes(params[name].nbytes)
                layer = model.model.layers[i]
                if layer.is_moe:
                    moe = getattr(layer, spec.moe_module)
                    dev = expert_device(i) if expert_device else device
                    weights = None
                    if read_experts:
                        fp8_block = block if block is not None and not fp8_dequantize else None
                        weights = read_expert_weights(reader, spec, i, config.hidden_size, dtype, dev, fp8_block)
                        bar.add_bytes(tensor_bytes(weights))
                    moe.experts = make_experts(weights, i)
    except BaseException:
        if ahead is not None:
            ahead.close(wait=False)
        raise
    if ahead is not None:
        ahead.close()
    model.eval()
    return model


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm_{major}{minor} (FP8 needs sm_89+)"
    return device.type


def _note_mtp_layers(names: list[str], config) -> None:
    """One log line for the checkpoint's MTP layers (past num_hidden_layers): not read."""
    count, layers = mtp_tensor_count(names, config.num_hidden_layers)
    if count:
        log.info("skipping %d tensors of %d MTP layer(s) (layers %s, past num_hidden_layers=%d; "
                 "num_nextn_predict_layers=%s): multi-token prediction is not run", count, len(layers),
                 ",".join(map(str, layers)), config.num_hidden_layers,
                 getattr(config, "num_nextn_predict_layers", "unset"))


def read_expert_weights(
    index, spec: ArchSpec, layer: int, hidden: int, dtype: torch.dtype, device: torch.device,
    fp8_block: tuple[int, int] | None = None,
) -> ExpertWeights:
    """Stack one layer's per-expert tensors: gate_up [E, 2I, H], down [E, H, I].

    `index`: a SafetensorsIndex, DummyWeights, or an fp8 reader (weights/fp8_loading.py), which
    dequantizes fp8 tensors into `dtype`. With fp8_block and fp8 expert tensors in the checkpoint:
    the fp8 form instead (codes, and gate's then up's block scales; see ExpertWeights)."""
    e_n, i_n = spec.num_experts, spec.moe_intermediate
    g0 = spec.expert_tensor_names(layer, 0)[0]
    if fp8_block is not None and getattr(index, "is_fp8", None) is not None and index.is_fp8(g0):
        return _read_fp8_experts(index, spec, layer, hidden, device, fp8_block)
    if torch.device(device).type == "cpu":  # 2 MB pages: one first-touch fault per 2 MB of the layer's copy
        gate_up = hugepages.empty((e_n, 2 * i_n, hidden), dtype)
        down = hugepages.empty((e_n, hidden, i_n), dtype)
    else:
        gate_up = torch.empty(e_n, 2 * i_n, hidden, dtype=dtype, device=device)
        down = torch.empty(e_n, hidden, i_n, dtype=dtype, device=device)
    if _is_dummy(index):  # random benchmark weights: one draw per tensor, not per expert
        g, _, d = spec.expert_tensor_names(layer, 0)
        index.fill(g, gate_up)
        index.fill(d, down)
        return ExpertWeights(gate_up=gate_up, down=down)
    for e in range(e_n):
        g, u, d = spec.expert_tensor_names(layer, e)
        index.fill(g, gate_up[e, :i_n])
        index.fill(u, gate_up[e, i_n:])
        index.fill(d, down[e])
    return ExpertWeights(gate_up=gate_up, down=down)


def _is_dummy(index) -> bool:
    return isinstance(index, DummyWeights) or isinstance(getattr(index, "dummy", None), DummyWeights)


def _read_fp8_experts(reader, spec: ArchSpec, layer: int, hidden: int, device: torch.device,
                      block: tuple[int, int]) -> ExpertWeights:
    """The fp8 ExpertWeights form: codes as stored, scales [E, 2*ceil(I/bn), ceil(H/bk)] (gate's block
    rows, then up's) and [E, ceil(H/bn), ceil(I/bk)]."""
    e_n, i_n = spec.num_experts, spec.moe_intermediate
    bn, bk = block
    nbi = -(-i_n // bn)
    f8 = torch.float8_e4m3fn
    gate_up = torch.empty(e_n, 2 * i_n, hidden, dtype=f8, device=device)
    down = torch.empty(e_n, hidden, i_n, dtype=f8, device=device)
    gu_s = torch.empty(e_n, 2 * nbi, -(-hidden // bk), dtype=torch.float32, device=device)
    d_s = torch.empty(e_n, -(-hidden // bn), -(-i_n // bk), dtype=torch.float32, device=device)
    if _is_dummy(reader):
        g, _, d = spec.expert_tensor_names(layer, 0)
        for t, s, name in ((gate_up, gu_s, g), (down, d_s, d)):
            reader.fill(name, t)
            reader.fill_scale(name, s)
    else:
        for e in range(e_n):
            g, u, d = spec.expert_tensor_names(layer, e)
            reader.fill(g, gate_up[e, :i_n])
            reader.fill_scale(g, gu_s[e, :nbi])
            reader.fill(u, gate_up[e, i_n:])
            reader.fill_scale(u, gu_s[e, nbi:])
            reader.fill(d, down[e])
            reader.fill_scale(d, d_s[e])
    return ExpertWeights(gate_up=gate_up, down=down, gate_up_scale=gu_s, down_scale=d_s, block=block)
