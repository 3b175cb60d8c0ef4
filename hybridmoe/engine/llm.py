"""Offline API shaped like SGLang's Engine: `LLM(model_path=..., **options).generate(...)`."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from hybridmoe import startup
from hybridmoe.config import EngineArgs
from hybridmoe.engine.engine import Engine
from hybridmoe.engine.request import Req, SamplingParams

log = logging.getLogger(__name__)


class LLM:
    """Loads a model and generates synchronously.

    `model_path` is a directory, a .gguf file or a Hugging Face Hub id (downloaded as `serve` does). Options are
    the `serve` flags in snake_case (`kt_method`, `chunked_prefill_size`, ...); an unknown option is an error
    naming it. The model and the options pass the startup checks of `serve`
    and `generate` first (startup.prepare): a bad config.json, tokenizer, chat template, shard or option
    is a ConfigError or CheckpointError with one line naming it, before anything loads.
    """

    def __init__(self, model_path: str | None = None, device: str = "auto", dtype: str = "auto",
                 progress: bool = True, **options: object) -> None:
        if model_path is not None:
            options["model_path"] = model_path
        from hybridmoe.hub import resolve_hub_paths

        # a Hub id (`org/name`, with revision / download_dir) as on the command line; without the checks a hostile
        # config.json reached the engine: 2^31-1 layers was a hang
        args = resolve_hub_paths(EngineArgs.from_kwargs(device=device, dtype=dtype, **options))
        self._start(startup.prepare(args), progress)

    @classmethod
    def from_prepared(cls, args: EngineArgs, progress: bool = True) -> LLM:
        """An LLM of args that startup.prepare returned (the command line checks before it builds one, to report a
        failure as one line; the checks are not run twice)."""
        llm = cls.__new__(cls)
        llm._start(args, progress)
        return llm

    def _start(self, args: EngineArgs, progress: bool) -> None:
        self.args = args
        self.engine = Engine(self.args, progress=progress)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: SamplingParams | dict | list | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        return_text_in_logprobs: bool = False,
        lora_path: str | list[str | None] | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (returns a dict) or a batch (a list of dicts).

        With n > 1 in the sampling parameters each prompt gives n outputs: a list, prompt after prompt.

        With stream=True (one prompt) returns an iterator of dicts whose `text` and `output_ids`
        are cumulative, the last one carrying the finish_reason.

        lora_path: a loaded LoRA adapter's name for every prompt, or a list with one per prompt
        (None: the base model).
        """
        batched = isinstance(prompt, list) or (isinstance(input_ids, list) and input_ids
                                                and isinstance(input_ids[0], list))
        prompts = prompt if isinstance(prompt, list) else None
        ids_list = input_ids if batched and input_ids is not None else None
        n = len(prompts) if prompts is not None else len(ids_list) if ids_list is not None else 1
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
        loras = lora_path if isinstance(lora_path, list) else [lora_path] * n
        if len(loras) != n:
            raise ValueError(f"got {len(loras)} lora_path entries for {n} prompts")
        reqs = [
            self.engine.make_request(
                prompt=prompts[i] if prompts is not None else (None if batched else prompt),
                input_ids=ids_list[i] if ids_list is not None else (None if batched else input_ids),
                sampling_params=params[i], return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                logprob_start_len=logprob_start_len, return_text_in_logprobs=return_text_in_logprobs,
                lora_path=loras[i])
            for i in range(n)
        ]
        every = [s for r in reqs for s in [r, *r.forks]]  # forks leave r.forks when they start
        if stream:
            if batched or len(every) > 1:
                raise ValueError("stream=True takes one prompt and n=1")
            return self._stream(reqs[0])
        for r in reqs:
            self.engine.submit(r)
        try:
            self.engine.run_until_done(every)
        except Exception:  # a failed step: end these requests (pages freed) so the engine stays usable
            for r in every:
                if not r.finished:
                    self.engine.abort(r.rid, "engine failure")
            self.engine.step()  # takes the aborts in before scheduling: nothing of them runs again
            raise
        outs = [Engine.output_dict(r, self.tokenizer) for r in every]
        return outs if batched or len(outs) > 1 else outs[0]

    def _stream(self, req: Req) -> Iterator[dict]:
        self.engine.submit(req)
        sent = -1
        try:
            while not req.finished:
                updated = self.engine.step()
                if any(r is req for r in updated) and (len(req.output_ids) != sent or req.finished):
                    sent = len(req.output_ids)
                    yield Engine.output_dict(req, self.tokenizer)
        finally:
            if not req.finished:  # the caller stopped iterating: free the request's pages
                self.engine.abort(req.rid)
                self.engine.step()

    def prompt_logits(self, input_ids: list[int]):
        """Logits [L, V] at every prompt position (float32, CPU)."""
        return self.engine.prompt_logits(input_ids)

    def shutdown(self) -> None:
        """Write the expert statistics if recording; release the model (GPU memory is freed when
        the object is collected)."""
        if self.engine is not None:
            self.engine.shutdown()
        self.engine = None  # type: ignore[assignment]

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
