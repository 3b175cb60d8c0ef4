"""`hybridmoe check --model FILE.gguf`: the --kt-method for a GGUF, the tensor types found, and why.

    method, why, types = gguf_method("model-Q4_K_M.gguf")
    # "LLAMAFILE", "the routed experts are GGUF blocks (Q4_K, Q6_K) the CPU kernels compute ...",
    # {"experts": {"Q4_K": 94, "Q6_K": 50}, "other": {"F32": 241, "Q4_K": 200, ...}}
"""

from __future__ import annotations

from collections import Counter

from hybridmoe.cpu import gguf_quant
from hybridmoe.gguf.reader import GGUFModel


def tensor_types(model: GGUFModel) -> dict[str, dict[str, int]]:
    """How many tensors of each type: the routed-expert tensors (*_exps), and all others."""
    experts, other = Counter(), Counter()
    for name, t in model.tensors.items():
        (experts if "_exps." in name else other)[t.type_name] += 1
    return {"experts": dict(sorted(experts.items())), "other": dict(sorted(other.items()))}


def gguf_method(path: str) -> tuple[str, str, dict[str, dict[str, int]]]:
    """(method, why, types) for serving the GGUF at `path`."""
    model = GGUFModel.open(path)
    types = tensor_types(model)
    names = ", ".join(types["experts"]) or "none"
    unsupported = sorted({t.type_name for n, t in model.tensors.items()
                          if "_exps." in n and t.type not in gguf_quant.TYPES})
    if not types["experts"]:
        return "LLAMAFILE", f"{path} has no routed-expert tensors (*_exps): nothing for the CPU engine", types
    if unsupported:
        supported = ", ".join(sorted(gguf_quant.TYPE_IDS))
        return ("BF16", f"the routed experts of {path} include {', '.join(unsupported)}, which the GGUF CPU kernels "
                f"do not compute (they do {supported}): convert them with `hybridmoe convert --input-type gguf "
                "--quant-method bf16` and serve with --kt-method BF16", types)
    return ("LLAMAFILE", f"the routed experts of {path} are GGUF blocks ({names}) the CPU kernels compute as they "
            "are (no conversion, nothing requantized): `--model` the GGUF alone, or --kt-method LLAMAFILE "
            "--kt-weight-path with a Hugging Face --model", types)
