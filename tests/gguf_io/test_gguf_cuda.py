"""The GGUF path on CUDA (the H200 run): `--model FILE.gguf` alone with 0, some and all experts on the
GPU (dequantized at load), the rest on the CPU kernels, graphs on, against the same file on the CPU
device; the bound is in cuda_parity.py."""

from __future__ import annotations

import pytest
import torch
from cuda_parity import check_cuda_against_cpu

PROMPT = torch.randint(0, 4000, (29,), generator=torch.Generator().manual_seed(5)).tolist()
GREEDY = {"max_new_tokens": 12, "temperature": 0}

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("gpu", [0, 3, 10])
def test_gguf_on_cuda_matches_the_cpu_device(qwen3_gguf, gpu):
    _, gguf, same = qwen3_gguf
    check_cuda_against_cpu(gguf, same, gpu, PROMPT, GREEDY, "GGUF")
