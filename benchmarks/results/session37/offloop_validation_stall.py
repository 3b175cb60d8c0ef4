import json, sys, threading, time
import httpx
sys.path.insert(0, "/work/main")
from hybridmoe.config import EngineArgs
from hybridmoe.engine.engine import Engine
from hybridmoe.server import app as app_module
from hybridmoe.server.limits import ServerLimits
from tests.server.inproc import serve_in_thread
def main():
    engine = Engine(EngineArgs(model_path="hybridmoe/demo_model", device="cpu"), progress=False)
    raw = json.dumps({"messages": [{"role": "user", "content": "a"}] * 200000}).encode()
    with serve_in_thread(lambda a: engine, limits=ServerLimits(tokenizer_workers=1)) as url:
        for mode in ("inline", "thread", "inline", "thread"):
            app_module.OFF_LOOP_VALIDATE_BYTES = 1 << 40 if mode == "inline" else 256 << 10
            worst = [0.0]; stop = [False]
            def probe():
                while not stop[0]:
                    t = time.perf_counter(); httpx.get(url + "/health", timeout=30); worst[0] = max(worst[0], time.perf_counter() - t)
                    time.sleep(0.005)
            th = threading.Thread(target=probe); th.start(); time.sleep(0.2)
            t = time.perf_counter()
            r = httpx.post(url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}, timeout=120)
            d = time.perf_counter() - t; time.sleep(0.1); stop[0] = True; th.join()
            print(f"{mode}: request {d:.2f} s ({r.status_code}), worst /health {worst[0]*1e3:.0f} ms", r.text[:300])

if __name__ == "__main__":
    main()
