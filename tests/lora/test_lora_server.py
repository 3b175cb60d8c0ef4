"""LoRA through the HTTP server (in-process uvicorn, the production routes): /generate lora_path
(one name, a list for a batch), OpenAI `model` "<served>:<adapter>" / "<adapter>", /v1/models,
/load_lora_adapter and /unload_lora_adapter at run time while requests run, the errors."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from lora_fixtures import hand_adapter, peft_adapter

from hybridmoe.config import EngineArgs
from hybridmoe.engine.engine import Engine
from tests.server.inproc import serve_in_thread

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory):
    from transformers import AutoConfig

    base = tiny_model_dir("qwen3_moe")
    d = tmp_path_factory.mktemp("srv_adapters")
    a1 = peft_adapter(base, d / "a1", seed=1)
    a2 = hand_adapter(AutoConfig.from_pretrained(str(base)), d / "a2", seed=4, r=6, with_experts=False)
    big = peft_adapter(base, d / "big", seed=5, r=32)
    args = EngineArgs(model_path=str(base), device="cpu", dtype="float32", chunked_prefill_size=8,
                      lora_paths=[f"one={a1}"], max_loras_per_batch=2, max_lora_rank=8,
                      lora_target_modules=["all"])
    engine = Engine(args, progress=False)
    with serve_in_thread(lambda _: engine, model_path=str(base), served_model_name="tiny") as url:
        yield url, engine, a1, a2, big


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 211, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _gen(url: str, prompt, lora=None) -> list:
    body = {"input_ids": prompt, "sampling_params": GREEDY}
    if lora is not None:
        body["lora_path"] = lora
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return [o["output_ids"] for o in out] if isinstance(out, list) else out["output_ids"]


def test_generate_models_and_errors(live):
    import peft

    from tiny_models import hf_model

    url, engine, a1, _, _ = live
    p = _prompt(21, 3)
    ref = peft.PeftModel.from_pretrained(hf_model(engine.args.model_path), str(a1)).eval()
    with torch.no_grad():
        want = ref.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 21:].tolist()
    assert _gen(url, p, "one") == want
    base = _gen(url, p)
    assert base != want
    assert _gen(url, [p, p], ["one", None]) == [want, base]
    models = httpx.get(url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny", "one"] and models[1]["parent"] == "tiny"
    r = httpx.post(url + "/generate", json={"input_ids": p, "lora_path": "nope"})
    assert r.status_code == 400 and "'nope'" in r.json()["error"]["message"]
    for model in ("tiny:nope", "nope"):
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": p, "max_tokens": 2})
        assert r.status_code == 404 and "'nope'" in r.json()["error"]["message"], r.text
    for model in ("tiny:one", "one"):  # the OpenAI route runs the adapter: its tokens are the adapter's
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": p, "max_tokens": 8, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200, r.text


def test_load_unload_reload_under_load(live):
    url, engine, a1, a2, big = live
    p = _prompt(30, 9)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            async def gen(lora):
                body = {"input_ids": p, "sampling_params": dict(GREEDY, max_new_tokens=24)}
                if lora:
                    body["lora_path"] = lora
                r = await c.post("/generate", json=body)
                assert r.status_code == 200, r.text
                return r.json()["output_ids"]

            alone = {k: await gen(k) for k in (None, "one")}
            running = [asyncio.create_task(gen(k)) for k in (None, "one", None, "one")]
            await asyncio.sleep(0.05)
            r = await c.post("/load_lora_adapter", json={"lora_name": "two", "lora_path": str(a2)})
            assert r.status_code == 200 and r.json()["success"], r.text
            assert r.json()["loaded_adapters"] == {"one": str(a1), "two": str(a2)}
            two = await gen("two")
            assert two not in alone.values()
            running += [asyncio.create_task(gen("two")) for _ in range(2)]
            await asyncio.sleep(0.05)
            r = await c.post("/unload_lora_adapter", json={"lora_name": "two"})
            assert r.status_code == 200 and r.json()["loaded_adapters"] == {"one": str(a1)}
            r = await c.post("/generate", json={"input_ids": p, "lora_path": "two"})
            assert r.status_code == 400
            r = await c.post("/load_lora_adapter", json={"lora_name": "two", "lora_path": str(a2)})
            assert r.json()["success"]
            outs = await asyncio.gather(*running)  # none lost; each gets what it gets alone
            assert outs == [alone[None], alone["one"], alone[None], alone["one"], two, two]
            assert await gen("two") == two
            # errors: rank over --max-lora-rank, duplicate name, unknown unload
            r = await c.post("/load_lora_adapter", json={"lora_name": "big", "lora_path": str(big)})
            assert r.status_code == 400 and "exceeds --max-lora-rank 8" in r.json()["error_message"]
            r = await c.post("/load_lora_adapter", json={"lora_name": "two", "lora_path": str(a2)})
            assert r.status_code == 400 and "already loaded" in r.json()["error_message"]
            r = await c.post("/unload_lora_adapter", json={"lora_name": "zz"})
            assert r.status_code == 400 and "'zz'" in r.json()["error_message"]

    asyncio.run(run())
