"""In-process vLLM serving an OCR VLM (default tencent/HunyuanOCR): the GPU engine.

vLLM is imported inside :meth:`VllmEngine.start`, so this module imports (and its settings
validate) on a machine without the ``gpu`` extra.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import os
import time
import uuid
from typing import Any

import numpy as np

from schemas.lanes import Priority
from schemas.reading import WARNING_TRUNCATED_MAX_TOKENS, WARNING_TRUNCATED_REPETITION
from services.common.cache.prompts import SPOTTING_PROMPT
from services.infer.engines import dialects, hunyuan, hunyuan_prompts
from services.infer.engines.base import (OCR, EngineOutput, EngineTask, EngineTimeout, EngineUnavailable, OcrEngine,
                                          tasks_of)

log = logging.getLogger(__name__)


def select_device(device: str, environ: dict | None = None) -> str | None:
    """Make ``device`` (``cuda:N``) the only GPU this process sees, before CUDA initialises.

    One infer process serves one GPU. With ``CUDA_VISIBLE_DEVICES`` unset it becomes ``N``;
    when it is already set (by the orchestrator) ``N`` indexes into that list. ``cpu`` or
    ``cuda`` leave it alone.

    Returns:
        The value of ``CUDA_VISIBLE_DEVICES`` afterwards (None when unset).

    Raises:
        ValueError: ``N`` is not an integer, or ``CUDA_VISIBLE_DEVICES`` lists ``N`` or fewer GPUs.
    """
    env = os.environ if environ is None else environ
    dev = (device or "").strip().lower()
    if not dev.startswith("cuda:"):
        return env.get("CUDA_VISIBLE_DEVICES")
    try:
        index = int(dev.split(":", 1)[1])
    except ValueError:
        raise ValueError(f"device {device!r}: expected cuda:N with N a GPU index") from None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        env["CUDA_VISIBLE_DEVICES"] = str(index)
    else:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if index >= len(ids):
            raise ValueError(f"device {device!r}: CUDA_VISIBLE_DEVICES={visible!r} has only {len(ids)} GPU(s)")
        env["CUDA_VISIBLE_DEVICES"] = ids[index]
    return env["CUDA_VISIBLE_DEVICES"]


def _supported_args(cls: type, wanted: dict[str, Any]) -> dict[str, Any]:
    """``wanted`` less the keys ``cls`` (a dataclass or any callable) does not take; logs drops."""
    if dataclasses.is_dataclass(cls):
        names = {f.name for f in dataclasses.fields(cls)}
    elif hasattr(cls, "__struct_fields__"):  # msgspec.Struct (vLLM's SamplingParams)
        names = set(cls.__struct_fields__)
    else:
        try:
            params = inspect.signature(cls).parameters
        except (TypeError, ValueError):
            return dict(wanted)
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return dict(wanted)
        names = set(params)
    dropped = sorted(k for k in wanted if k not in names)
    if dropped:
        log.warning("vllm: %s does not take %s in this vLLM version; ignored", cls.__name__, ", ".join(dropped))
    return {k: v for k, v in wanted.items() if k in names}


class VllmEngine(OcrEngine):
    """vLLM's async engine in this process: continuous batching across every page in flight.

    Every page is its own request (own id, :meth:`page`); the infer window keeps :attr:`slots`
    of them submitted, so vLLM's scheduler always has pages to admit. Each has its own timeout,
    after which the request is aborted and the page gets :class:`EngineTimeout`. Output is streamed; when the text ends in a runaway
    loop (:func:`~services.infer.engines.hunyuan.find_tail_loop`: a unit of 3+ distinct
    characters repeated over 256+ characters, or 12 identical lines; runs of one character such
    as ``______`` or ``000000`` never count) the request is aborted early, the text so far is
    parsed and the output carries the warning ``truncated_repetition``. A generation that hits
    ``max_tokens`` (``finish_reason`` "length") carries ``truncated_max_tokens``. vLLM has no
    stop-on-repetition of its own. The text is checked every :attr:`check_every` characters
    once it is :attr:`check_after` long.

    Args:
        model: HF id or local path (no download happens when it is a local path or already in
            the HF cache; with ``HF_HUB_OFFLINE=1`` nothing is fetched).
        revision: HF revision of the model, or None.
        device: ``cuda:N``; sets ``CUDA_VISIBLE_DEVICES`` (see :func:`select_device`).
        prompt: The instruction (default: HunyuanOCR's text-spotting prompt).
        prompt_template: ``auto`` (HunyuanOCR's raw prompt for a model named like HunyuanOCR,
            else the tokenizer's chat template), ``hunyuan`` (that raw prompt), ``chat``, or a
            literal string with ``{prompt}`` (see :meth:`prompt_mode`).
        max_tokens: Generation cap per image.
        repetition_penalty: vLLM sampling repetition penalty (1.0 = off, the recipe's value).
        top_k: Sampling ``top_k`` (1 = greedy, the recipe's value; -1 or 0 = off).
        max_side: Longest image side in pixels handed to the engine (the infer stage downscales
            or tiles larger pages); default :data:`~services.infer.engines.hunyuan_prompts.VLM_MAX_SIDE`.
        repeat_stop: Abort a request whose text ends in a loop.
        engine_args: Extra ``AsyncEngineArgs`` fields (``load_format``, ``enforce_eager``, ...),
            which override the ones built here.
        sampling_args: Extra ``SamplingParams`` fields (``ignore_eos`` for benchmarks, ...).
        warmup_timeout_s: Time limit of the warm-up request.
        dialect: Prompts, sampling and parsers of the tasks other than ``ocr``
            (:mod:`services.infer.engines.dialects`: ``auto``, ``hunyuan``, ``generic``); each
            such instruction is wrapped as ``prompt`` is (:meth:`prompt_mode`), ``max_tokens``
            is the smaller of the dialect's for the task and this engine's, and ``sampling_args``
            apply over it. Task ``ocr`` is unchanged.
        scheduling_policy: vLLM's ``scheduling_policy``: ``priority`` (the default here) admits
            interactive pages before bulk ones; ``fcfs`` in arrival order.
    """

    name = "vllm"
    tasks = tasks_of("vllm")
    max_side = hunyuan_prompts.VLM_MAX_SIDE
    check_every = 256
    check_after = 512
    check_window = 6000

    def __init__(
        self,
        model: str = "tencent/HunyuanOCR",
        *,
        revision: str | None = None,
        device: str = "cuda:0",
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.90,
        max_num_seqs: int = 64,
        max_model_len: int = 16384,
        max_num_batched_tokens: int = 32768,
        trust_remote_code: bool = True,
        enforce_eager: bool = False,
        prompt: str = SPOTTING_PROMPT,
        prompt_template: str = "auto",
        max_tokens: int = 4096,
        repetition_penalty: float = hunyuan_prompts.DEFAULT_REPETITION_PENALTY,
        top_k: int = hunyuan_prompts.DEFAULT_TOP_K,
        max_side: int | None = None,
        repeat_stop: bool = True,
        engine_args: dict[str, Any] | None = None,
        sampling_args: dict[str, Any] | None = None,
        warmup_timeout_s: float = 600.0,
        dialect: str = "auto",
        scheduling_policy: str = "priority",
    ):
        self.model = model
        self.scheduling_policy = scheduling_policy
        self._priority = False  # set in start(): the lane goes to vLLM as the request's priority
        self._in_flight = 0
        self.revision = revision
        self.device = device
        self.dtype = dtype
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.trust_remote_code = trust_remote_code
        self.enforce_eager = enforce_eager
        self.prompt = prompt
        self.prompt_template = prompt_template
        self.max_tokens = max_tokens
        self.repetition_penalty = repetition_penalty
        self.top_k = top_k
        if max_side:
            self.max_side = max_side
        self.repeat_stop = repeat_stop
        self.engine_args = dict(engine_args or {})
        self.sampling_args = dict(sampling_args or {})
        self.warmup_timeout_s = warmup_timeout_s
        self.dialect = dialects.dialect(dialect, model)
        self._engine = None
        self._sampling = None
        self._sampling_cls: Any = None
        self._prompt_text: str | None = None
        self._task_inputs: dict[EngineTask, tuple[str, Any, int]] = {}  # task -> (prompt, SamplingParams, max_tokens)
        self.output_tokens = 0
        """Tokens generated since start, every request (warm-up, timed out and stopped ones
        included, as far as they got): the GPU check's output tokens/s (bench/gpu/tasks.py)."""

    @classmethod
    def from_settings(cls, s) -> VllmEngine:
        """Build from :class:`~services.infer.settings.InferSettings`."""
        if s.engine.model != s.vllm_model:  # this engine runs whatever engine.engine says
            log.warning(
                "vllm: engine.model=%r (the cache key) differs from vllm_model=%r (what is loaded)",
                s.engine.model, s.vllm_model,
            )
        return cls(
            s.vllm_model, revision=s.vllm_revision, device=s.device, dtype=s.vllm_dtype,
            gpu_memory_utilization=s.vllm_gpu_memory_utilization, max_num_seqs=s.vllm_max_num_seqs,
            max_model_len=s.vllm_max_model_len, max_num_batched_tokens=s.vllm_max_num_batched_tokens,
            trust_remote_code=s.vllm_trust_remote_code, enforce_eager=s.vllm_enforce_eager,
            prompt=s.vllm_prompt, prompt_template=s.vllm_prompt_template, max_tokens=s.vllm_max_tokens,
            repetition_penalty=s.vllm_repetition_penalty, max_side=s.engine_max_side, repeat_stop=s.vllm_repeat_stop,
            engine_args=s.vllm_engine_args, sampling_args=s.vllm_sampling_args,
            warmup_timeout_s=s.vllm_warmup_timeout_s, dialect=s.vlm_dialect,
            scheduling_policy=s.vllm_scheduling_policy,
        )

    # ------------------------------------------------------------------ lifecycle

    def engine_kwargs(self, arg_fields: set[str] | None = None) -> dict[str, Any]:
        """The ``AsyncEngineArgs`` built from the settings. With ``arg_fields`` (the field names
        of this vLLM's ``AsyncEngineArgs``), the multimodal processor cache is switched off
        under whichever name that version has."""
        kw: dict[str, Any] = dict(
            model=self.model,
            revision=self.revision,
            dtype=self.dtype,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=False,
            limit_mm_per_prompt={"image": 1},
            trust_remote_code=self.trust_remote_code,
            enforce_eager=self.enforce_eager,
            disable_log_stats=True,
            scheduling_policy=self.scheduling_policy,
        )
        if arg_fields is None or "mm_processor_cache_gb" in arg_fields:
            kw["mm_processor_cache_gb"] = 0  # vLLM >= 0.10.2
        elif "disable_mm_preprocessor_cache" in arg_fields:
            kw["disable_mm_preprocessor_cache"] = True  # older releases
        kw.update(self.engine_args)
        return kw

    async def start(self) -> None:
        """Pick the GPU, load the model (minutes the first time), answer a warm-up image.

        Raises:
            ValueError: a bad ``device`` (see :func:`select_device`).
            RuntimeError: vLLM is not installed (the ``gpu`` extra), the model has no chat
                template in ``chat`` mode, or the warm-up image failed (its error chained).
            Exception: whatever vLLM raises while loading (model not found, out of GPU memory).
        """
        select_device(self.device)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        try:
            import vllm  # noqa: F401
            from vllm import AsyncEngineArgs, SamplingParams
        except ImportError as exc:  # pragma: no cover - depends on the gpu extra
            raise RuntimeError("engine 'vllm' needs the gpu extra (pip install 'ocrstream[gpu]')") from exc
        try:
            from vllm.v1.engine.async_llm import AsyncLLM as Engine
        except ImportError:  # pragma: no cover - older vLLM
            from vllm import AsyncLLMEngine as Engine

        fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        args = AsyncEngineArgs(**_supported_args(AsyncEngineArgs, self.engine_kwargs(fields)))
        # the lane as the request's priority only where this vLLM took the policy and its
        # generate() takes a priority (vLLM refuses a non-zero priority under fcfs)
        self._priority = (getattr(args, "scheduling_policy", "fcfs") == "priority"
                          and "priority" in inspect.signature(Engine.generate).parameters)
        t0 = time.perf_counter()
        log.info("vllm: loading %s (vLLM %s) on CUDA_VISIBLE_DEVICES=%s", self.model, vllm.__version__,
                 os.environ.get("CUDA_VISIBLE_DEVICES"))
        self._engine = Engine.from_engine_args(args)
        log.info("vllm: engine up in %.1f s", time.perf_counter() - t0)

        self._sampling_cls = SamplingParams
        self._sampling = SamplingParams(**_supported_args(SamplingParams, self.sampling_kwargs()))
        self._prompt_text = await self._render_prompt()
        log.info("vllm: prompt %r", self._prompt_text[:300])

        warm = np.full((96, 384, 3), 255, dtype=np.uint8)
        warm[40:56, 24:340] = 0
        try:
            res = await self.page(warm, OCR, timeout_s=self.warmup_timeout_s)
        except Exception as exc:
            raise RuntimeError(f"vllm warm-up failed: {exc!r}") from exc
        log.info("vllm: warm-up answered in %.0f ms (%d segments)", res.inference_ms, len(res.segments))
        self.ready = True

    def sampling_kwargs(self, task: EngineTask = OCR) -> dict[str, Any]:
        """The ``SamplingParams`` fields. Task ``ocr``: greedy as vLLM's HunyuanOCR recipe
        (temperature 0, ``top_k``, ``repetition_penalty``) and ``max_tokens``; another task: the
        dialect's (:meth:`Dialect.sampling`), ``max_tokens`` capped at this engine's; then
        ``sampling_args`` over them."""
        if task.name == "ocr":
            kw: dict[str, Any] = dict(temperature=0.0, top_k=self.top_k, max_tokens=self.max_tokens,
                                      repetition_penalty=self.repetition_penalty, skip_special_tokens=True)
        else:
            sp = self.dialect.sampling(task)
            kw = dict(temperature=sp.temperature, top_p=sp.top_p, max_tokens=min(sp.max_tokens, self.max_tokens),
                      skip_special_tokens=True)
            if sp.top_k is not None:
                kw["top_k"] = sp.top_k
            if sp.repetition_penalty is not None:
                kw["repetition_penalty"] = sp.repetition_penalty
        kw.update(self.sampling_args)
        return kw

    def prompt_mode(self) -> str:
        """``hunyuan``, ``chat`` or ``literal``: how :meth:`_render_prompt` builds the prompt.
        ``auto`` is ``hunyuan`` for a model named like HunyuanOCR (any case, ``-``/``_``
        ignored), else ``chat``; any other value is a literal template."""
        mode = self.prompt_template
        if mode == "auto":
            return "hunyuan" if "hunyuanocr" in self.model.lower().replace("-", "").replace("_", "") else "chat"
        return mode if mode in ("hunyuan", "chat") else "literal"

    async def _render_prompt(self, instruction: str | None = None) -> str:
        """The whole prompt text for ``instruction`` (default ``prompt``), per :meth:`prompt_mode`."""
        instruction = self.prompt if instruction is None else instruction
        mode = self.prompt_mode()
        if mode == "hunyuan":
            return hunyuan_prompts.render_template(hunyuan_prompts.HUNYUAN_RAW_TEMPLATE, instruction)
        if mode == "literal":
            if "{prompt}" not in self.prompt_template:
                log.warning("vllm: prompt_template has no {prompt}; the instruction is not sent")
            return hunyuan_prompts.render_template(self.prompt_template, instruction)
        tok = getattr(self._engine, "tokenizer", None)
        if tok is None and hasattr(self._engine, "get_tokenizer"):
            tok = self._engine.get_tokenizer()
            if inspect.isawaitable(tok):
                tok = await tok
        tok = getattr(tok, "tokenizer", tok)  # old vLLM: a TokenizerGroup
        if tok is None or not getattr(tok, "chat_template", None):
            raise RuntimeError(
                f"model {self.model!r} has no chat template; set vllm_prompt_template to a string with {{prompt}}"
            )
        return tok.apply_chat_template(hunyuan_prompts.template_messages(instruction), tokenize=False,
                                       add_generation_prompt=True)

    async def _inputs(self, task: EngineTask) -> tuple[str, Any, int]:
        """The prompt text, ``SamplingParams`` and ``max_tokens`` for ``task`` (built once per task)."""
        if task.name == "ocr":
            return self._prompt_text, self._sampling, self.max_tokens
        got = self._task_inputs.get(task)
        if got is None:
            kw = self.sampling_kwargs(task)
            sampling = self._sampling_cls(**_supported_args(self._sampling_cls, kw))
            got = (await self._render_prompt(self.dialect.sampling(task).prompt), sampling, kw["max_tokens"])
            if len(self._task_inputs) < 1024:  # extract's field lists are many: keep a bounded few
                self._task_inputs[task] = got
        return got

    def dead(self, exc: BaseException | None = None) -> bool:
        """True when vLLM's engine core is gone: the engine says ``errored``, or ``exc`` is
        vLLM's ``EngineDeadError`` (v1) / ``AsyncEngineDeadError`` (older). It does not come
        back in this process."""
        if exc is not None and any(c.__name__ in ("EngineDeadError", "AsyncEngineDeadError")
                                   for c in type(exc).__mro__):
            return True
        try:
            return bool(getattr(self._engine, "errored", False))
        except Exception:  # pragma: no cover - a property of a broken engine
            return True

    async def health(self) -> bool:
        """True when started and vLLM's engine core is alive (``errored`` False and
        ``check_health()`` passes); a dead core makes :attr:`ready` False for good."""
        if not self.ready or self._engine is None:
            return False
        try:
            if self.dead():
                raise RuntimeError("vLLM engine errored")
            check = getattr(self._engine, "check_health", None)
            if check is not None:
                res = check()
                if inspect.isawaitable(res):
                    await res
        except Exception as exc:
            log.error("vllm: engine core dead (%r): not ready", exc)
            self.ready = False
            return False
        return True

    async def close(self) -> None:
        """Shut the engine (and its core process) down."""
        eng, self._engine = self._engine, None
        self.ready = False
        if eng is not None and hasattr(eng, "shutdown"):
            try:
                res = eng.shutdown()
                if inspect.isawaitable(res):
                    await res
            except Exception:  # pragma: no cover
                log.exception("vllm: shutdown failed")

    # ------------------------------------------------------------------ inference

    async def _abort(self, request_id: str) -> None:
        try:
            res = self._engine.abort(request_id)
            if inspect.isawaitable(res):
                await res
        except Exception:  # pragma: no cover - finished requests may refuse
            log.debug("vllm: abort %s failed", request_id, exc_info=True)

    async def _generate(self, image: np.ndarray, request_id: str, task: EngineTask = OCR,
                        lane: Priority = "bulk") -> tuple[str, tuple[str, ...]]:
        """One request; returns its (possibly early-stopped) text and its warnings."""
        from PIL import Image

        prompt, sampling, max_tokens = await self._inputs(task)
        inputs = {"prompt": prompt, "multi_modal_data": {"image": Image.fromarray(image[..., :3])}}
        text, checked, finish, tokens = "", 0, None, 0
        extra = {"priority": 0 if lane == "interactive" else 1} if self._priority else {}
        try:
            async for out in self._engine.generate(inputs, sampling, request_id, **extra):
                if out.outputs:
                    text = out.outputs[0].text
                    finish = getattr(out.outputs[0], "finish_reason", None) or finish
                    tokens = len(getattr(out.outputs[0], "token_ids", None) or ())  # cumulative output
                if self.repeat_stop and len(text) - checked >= self.check_every and len(text) >= self.check_after:
                    checked = len(text)
                    if hunyuan.has_tail_repetition(text[-self.check_window:]):
                        log.info("vllm: %s stuck in a loop after %d chars; stopped", request_id, len(text))
                        await self._abort(request_id)
                        return text, (WARNING_TRUNCATED_REPETITION,)
        finally:
            self.output_tokens += tokens
        if finish == "length":
            log.info("vllm: %s cut at max_tokens=%d", request_id, max_tokens)
            return text, (WARNING_TRUNCATED_MAX_TOKENS,)
        return text, ()

    @property
    def slots(self) -> int:
        """Twice ``max_num_seqs``: as many pages again wait in vLLM's own queue, so its scheduler
        always has one to admit when a sequence ends."""
        return 2 * self.max_num_seqs

    @property
    def busy(self) -> int:
        """Requests submitted to vLLM and not finished (running or waiting in its queue)."""
        return self._in_flight

    async def page(self, image: np.ndarray, task: EngineTask, timeout_s: float,
                   lane: Priority = "bulk") -> EngineOutput:
        """See :meth:`OcrEngine.page`: one vLLM request, streamed; vLLM's scheduler batches the
        requests of every concurrent call (continuous batching). With the ``priority``
        scheduling policy the lane is the request's priority (0 interactive, 1 bulk: vLLM admits
        the lower first). The timeout starts at submission; past it the request is aborted.

        Raises:
            RuntimeError: called before :meth:`start`.
            UnsupportedTask: a task not in :attr:`tasks`.
            EngineTimeout: past ``timeout_s``.
            EngineUnavailable: vLLM's engine core died (see :meth:`dead`); :attr:`ready` turns
                False and stays so (the process must be restarted).
        """
        if self._engine is None:
            raise RuntimeError("vllm engine not started")
        if not self.supports(task):
            raise self.unsupported(task)
        image = np.ascontiguousarray(image)
        h, w = image.shape[:2]
        padded = hunyuan_prompts.pad_for_vlm(image)
        ph, pw = padded.shape[:2]
        request_id = f"ocr-{uuid.uuid4().hex}"
        started = time.perf_counter()
        self._in_flight += 1
        try:
            text, warnings = await asyncio.wait_for(self._generate(padded, request_id, task, lane), timeout_s)
        except asyncio.TimeoutError:
            await self._abort(request_id)
            raise EngineTimeout(f"inference took longer than {timeout_s:g} s") from None
        except Exception as exc:
            await self._abort(request_id)
            if self.dead(exc) or self.dead():
                if self.ready:
                    log.error("vllm: engine core dead (%r): not ready; restart this process", exc)
                self.ready = False
                raise EngineUnavailable(f"vLLM engine core dead: {exc!r}") from exc
            raise
        finally:
            self._in_flight -= 1
        if task.name != "ocr":
            out = dialects.task_output(self.dialect, task, text, warnings, started)
        else:
            out = hunyuan.answer_to_output(text, (pw, ph), (w, h), warnings, started)
        if isinstance(out, BaseException):  # the parsers return the page's failure: unparsable_output, engine_error
            raise out
        return out
