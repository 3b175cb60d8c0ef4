"""The HTTP server: SGLang's native API and the OpenAI API over one engine thread.

app.py (routes, errors, API key), openai_api.py (OpenAI routes), protocol.py (request schemas),
async_engine.py (engine thread <-> asyncio), state.py (request construction), streaming.py (SSE and
disconnects), metrics.py (Prometheus), errors.py (JSON errors), run.py (uvicorn, graceful shutdown).
"""
