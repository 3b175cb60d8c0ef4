"""Information and control routes beside the generation API, as SGLang names them: `/v1/models/{id}`,
`/get_load`, `/model_info` and `/server_info` (the new names of `/get_model_info` and
`/get_server_info`, both served), and the expert-distribution record endpoints, whose dump is the
statistics file `--init-expert-location` reads (moe/placement.py)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request

from hybridmoe.engine.request import is_unicode
from hybridmoe.server.errors import APIError
from hybridmoe.server.state import ServerState


def model_card(state: ServerState) -> dict[str, Any]:
    """The OpenAI model object of this server's model."""
    return {"id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "hybridmoe",
            "root": state.args.model_path, "max_model_len": state.core.context_len}


def model_info(state: ServerState) -> dict[str, Any]:
    """SGLang's /get_model_info fields."""
    core = state.core
    cfg = core.hf_config
    return {"model_path": state.args.model_path, "tokenizer_path": state.args.tokenizer_path or state.args.model_path,
            "served_model_name": state.model_name, "is_generation": True, "context_length": core.context_len,
            "vocab_size": cfg.vocab_size, "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None), "eos_token_ids": list(core.eos_ids),
            "preferred_sampling_params": state.sampling.preferred_text, "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False}


def load(state: ServerState) -> list[dict[str, Any]]:
    """SGLang's /get_load: one entry per data-parallel rank (one here)."""
    s = state.engine.stats
    running, waiting = s.get("num_running_reqs", 0), s.get("num_queue_reqs", 0)
    return [{"dp_rank": 0, "num_reqs": running + waiting, "num_running_reqs": running, "num_waiting_reqs": waiting,
             "num_tokens": s.get("num_used_tokens", 0), "token_usage": s.get("token_usage", 0.0),
             "max_total_num_tokens": s.get("max_total_num_tokens", 0)}]


def _recorder(engine):
    rec = engine.runner.recorder
    if rec is None:
        raise APIError(400, "this model has no MoE layers to record")
    return rec


def dump_dir(args) -> Path:
    """Where a client may have the record written: the directory of --record-expert-distribution's file, else the
    temp directory (where a dump without a path goes)."""
    if args.record_expert_distribution:
        return Path(args.record_expert_distribution).resolve().parent
    return Path(tempfile.gettempdir()).resolve()


def _check_dump_path(path: str, root: Path) -> None:
    """APIError(400) unless `path` names a file to write inside `root` (dump_dir).

    A client's path was any path the server's user can write: without --api-key any client could overwrite the
    server's own files (resolved, so neither "../" nor a symbolic link leads out of `root`). A NUL, a lone surrogate
    (JSON's "\\ud800") or an over-long name made the filesystem calls raise ValueError/OSError (500 with a
    traceback); an existing directory failed only after the record's temporary file was written beside it."""
    if "\x00" in path or not is_unicode(path):
        raise APIError(400, "path must be a file name without NUL characters or lone surrogates", param="path")
    try:
        target = Path(path).resolve()
        ok_dir = target.parent.is_dir()
        is_dir = target.is_dir()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
        raise APIError(400, f"path {_shown(path)}: {getattr(e, 'strerror', None) or e}", param="path") from None
    if not target.is_relative_to(root):
        raise APIError(400, f"path {_shown(path)}: outside {root}, the directory this server writes records to "
                            "(that of --record-expert-distribution, else the temp directory)", param="path")
    if not ok_dir:
        raise APIError(400, f"path {_shown(path)}: the directory does not exist", param="path")
    if is_dir:
        raise APIError(400, f"path {_shown(path)}: is a directory; give a file name", param="path")
    if target.exists() and not target.is_file():  # a FIFO or socket there would be replaced by the rename
        raise APIError(400, f"path {_shown(path)}: exists and is not a regular file", param="path")


def _shown(path: str) -> str:
    """A client's path as an error message quotes it: at most 200 characters."""
    return path if len(path) <= 200 else path[:197] + "..."


def register_routes(app: FastAPI, state: ServerState) -> None:
    """Adds the routes of this module (the generation routes are app.py's and openai_api.py's)."""

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        """The model object when `model_id` names this server's model, else 404."""
        try:
            state.check_model(model_id)
        except APIError:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {state.model_name!r}",
                           param="model") from None
        return model_card(state)

    @app.get("/model_info")
    async def get_model_info() -> dict[str, Any]:
        return model_info(state)

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return state.server_info()

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        state.engine.check_available()
        return load(state)

    @app.api_route("/start_expert_distribution_record", methods=["GET", "POST"])
    async def start_record() -> dict[str, Any]:
        """Start a new record of which routed experts each token selects (per MoE layer)."""
        await state.engine.call(lambda e: _recorder(e).start())
        return {"success": True, "message": "Start recording the expert distribution"}

    @app.api_route("/stop_expert_distribution_record", methods=["GET", "POST"])
    async def stop_record() -> dict[str, Any]:
        await state.engine.call(lambda e: _recorder(e).stop())
        return {"success": True, "message": "Stop recording the expert distribution"}

    @app.api_route("/dump_expert_distribution_record", methods=["GET", "POST"])
    async def dump_record(request: Request) -> dict[str, Any]:
        """Write the record (the statistics file of `--init-expert-location`). Where: `path` (query or
        JSON body; inside dump_dir), else --record-expert-distribution's file, else a new file in the temp
        directory."""
        path = request.query_params.get("path")
        if path is None and request.method == "POST":
            body = await request.body()
            if body.strip():
                try:
                    data = await request.json()
                except ValueError:
                    raise APIError(400, "the body must be JSON: {\"path\": \"FILE\"} or empty") from None
                if isinstance(data, dict) and data.get("path") is not None:
                    if not isinstance(data["path"], str) or not data["path"]:
                        raise APIError(400, "path must be a non-empty string", param="path")
                    path = data["path"]
        if path is not None:
            _check_dump_path(path, dump_dir(state.args))

        def dump(engine) -> str:
            rec = _recorder(engine)
            target = path or rec.path or str(Path(tempfile.gettempdir()) /
                                             f"expert_distribution_{time.strftime('%Y%m%d-%H%M%S')}.json")
            return rec.dump(target)

        try:
            written = await state.engine.call(dump)
        except OSError as e:  # the client's path cannot be written (no permission, name too long, ...): its fault
            if path is None:
                raise
            raise APIError(400, f"path {_shown(path)}: cannot be written ({e.strerror or e})", param="path") from None
        return {"success": True, "message": f"Expert distribution written to {written}", "path": written}
