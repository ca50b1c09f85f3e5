"""VllmEngine's own logic with a fake of vLLM's async engine (no vllm, torch or GPU needed).

``VllmEngine.start`` imports vLLM lazily (``import vllm``; ``from vllm import AsyncEngineArgs,
SamplingParams``; ``from vllm.v1.engine.async_llm import AsyncLLM``), so a fake ``vllm`` package
put in ``sys.modules`` stands in for it. The fake engine streams cumulative outputs as vLLM's
``AsyncLLM.generate`` does (``RequestOutput.outputs[0].text`` / ``.finish_reason``); what it
streams is chosen per request by the red channel of the image's first pixel.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest

from tests.engines import read_all
from services.common.errors import is_transient
from services.common.cache.prompts import SPOTTING_PROMPT
from services.infer.engines.base import OCR
from services.infer.engines import hunyuan, hunyuan_prompts
from services.infer.engines.base import EngineOutput, EngineTimeout, EngineUnavailable
from services.infer.engines.vllm_engine import VllmEngine, _supported_args, select_device

OK, LENGTH, LOOP, FORM, SLOW, RAISE, NESTED, DIE = 10, 20, 30, 40, 50, 60, 70, 80
ANSWER = "INVOICE(100,50),(400,90)\n发票号码(600,52),(800,88)\nTOTAL 97.50(100,900),(500,950)"
CUT = "INVOICE(100,50),(400,90)\nTOTAL 97.50(100,9"
LOOP_ITEM = "重复(10,40),(90,60)"
FORM_PAGE = (
    "Signature: " + "_" * 300 + "(100,50),(400,90)\n"
    "Total 1" + "0" * 300 + "(100,100),(400,120)\n"
    "Chapter 1 " + "." * 400 + " 5(100,150),(400,170)\n"
    "Chapter 2 " + ". " * 200 + "9(100,200),(400,220)\n"
)


@dataclasses.dataclass
class EngineArgs:
    """This vLLM's AsyncEngineArgs: no ``disable_log_stats`` (dropped with a warning)."""

    model: str
    revision: str | None = None
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    limit_mm_per_prompt: dict | None = None
    trust_remote_code: bool = False
    enforce_eager: bool = False
    mm_processor_cache_gb: float = 4
    load_format: str = "auto"
    scheduling_policy: str = "fcfs"


class SamplingParams:
    """msgspec-like (``__struct_fields__``), as vLLM's; this one has no ``top_k``."""

    __struct_fields__ = ("temperature", "max_tokens", "repetition_penalty", "skip_special_tokens", "ignore_eos")

    def __init__(self, **kw):
        self.kw = kw


class Tokenizer:
    def __init__(self, template: str | None = "tmpl"):
        self.chat_template = template
        self.calls: list = []

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        self.calls.append((messages, tokenize, add_generation_prompt))
        return f"<chat>{messages[1]['content'][1]['text']}</chat>"


class EngineDeadError(Exception):
    """Named as ``vllm.v1.engine.exceptions.EngineDeadError``."""


class FakeAsyncLLM:
    """The parts of ``vllm.v1.engine.async_llm.AsyncLLM`` that VllmEngine uses."""

    last: "FakeAsyncLLM | None" = None
    tokenizer_template: str | None = "tmpl"

    def __init__(self, args):
        self.args = args
        self.prompts: list[str] = []
        self.aborted: list[str] = []
        self.chunks_sent: dict[str, int] = {}
        self.priorities: list[int] = []
        self.shut = False
        self.errored = False
        self.tok = Tokenizer(self.tokenizer_template)

    @classmethod
    def from_engine_args(cls, args):
        cls.last = cls(args)
        return cls.last

    async def get_tokenizer(self):
        return self.tok

    async def abort(self, request_id):
        self.aborted.append(request_id)

    def shutdown(self):
        self.shut = True

    async def check_health(self):
        if self.errored:
            raise EngineDeadError("engine dead")

    @staticmethod
    def _out(text, finish=None):
        # one token per character, cumulative as vLLM's default RequestOutputKind.CUMULATIVE
        return SimpleNamespace(outputs=[SimpleNamespace(text=text, finish_reason=finish, token_ids=list(range(len(text))))])

    async def generate(self, inputs, sampling, request_id, priority: int = 0):
        self.prompts.append(inputs["prompt"])
        self.priorities.append(priority)
        kind = inputs["multi_modal_data"]["image"].getpixel((0, 0))[0]
        self.chunks_sent[request_id] = 0

        async def stream(text, finish, size=7, delay=0.0):
            for i in range(size, len(text) + size, size):
                self.chunks_sent[request_id] += 1
                if delay:
                    await asyncio.sleep(delay)
                else:
                    await asyncio.sleep(0)
                yield self._out(text[:i], finish if i >= len(text) else None)

        if kind == LENGTH:
            async for o in stream(CUT, "length"):
                yield o
        elif kind == LOOP:
            text = "Title(10,10),(90,30)\n"
            for _ in range(1000):  # would run to max_tokens
                text += LOOP_ITEM
                self.chunks_sent[request_id] += 1
                await asyncio.sleep(0)
                yield self._out(text)
            yield self._out(text, "length")
        elif kind == FORM:
            async for o in stream(FORM_PAGE, "stop"):
                yield o
        elif kind == SLOW:
            async for o in stream(ANSWER, "stop", delay=5.0):
                yield o
        elif kind == NESTED:
            async for o in stream("[" * 5000, "length", size=500):
                yield o
        elif kind == RAISE:
            raise RuntimeError("engine core died")
            yield  # pragma: no cover
        elif kind == DIE:  # as vLLM v1 when the engine core process is gone
            self.errored = True
            raise EngineDeadError("EngineCore encountered an issue")
            yield  # pragma: no cover
        else:
            async for o in stream(ANSWER, "stop"):
                yield o


@pytest.fixture
def fake_vllm(monkeypatch):
    """A fake ``vllm`` package in sys.modules (the AsyncLLM under vllm.v1.engine.async_llm)."""
    FakeAsyncLLM.last = None
    FakeAsyncLLM.tokenizer_template = "tmpl"
    root = types.ModuleType("vllm")
    root.__version__ = "0.0-fake"
    root.__path__ = []
    root.AsyncEngineArgs = EngineArgs
    root.SamplingParams = SamplingParams
    mods = {"vllm": root}
    for name in ("vllm.v1", "vllm.v1.engine", "vllm.v1.engine.async_llm"):
        mods[name] = types.ModuleType(name)
        mods[name].__path__ = []
    mods["vllm.v1.engine.async_llm"].AsyncLLM = FakeAsyncLLM
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return FakeAsyncLLM


def page(kind: int, w: int = 1000, h: int = 1000) -> np.ndarray:
    img = np.full((h, w, 3), 255, dtype=np.uint8)
    img[0, 0] = (kind, 0, 0)
    return img


async def started(model: str = "tencent/HunyuanOCR", **kw) -> VllmEngine:
    kw.setdefault("device", "cpu")  # leaves CUDA_VISIBLE_DEVICES alone
    eng = VllmEngine(model, **kw)
    await eng.start()
    return eng


# --------------------------------------------------------------------------- prompts


async def test_auto_prompt_for_hunyuan_is_the_raw_template(fake_vllm):
    eng = await started("/models/Hunyuan_OCR")  # any case, - and _ ignored
    assert eng.prompt_mode() == "hunyuan" and eng.ready
    want = hunyuan_prompts.render_template(hunyuan_prompts.HUNYUAN_RAW_TEMPLATE, SPOTTING_PROMPT)
    assert fake_vllm.last.prompts == [want]  # the warm-up request
    assert fake_vllm.last.tok.calls == []
    await eng.close()
    assert fake_vllm.last.shut and not eng.ready


async def test_auto_prompt_for_other_models_uses_the_chat_template(fake_vllm):
    eng = await started("Qwen/Qwen2-VL-2B-Instruct", prompt="read it")
    assert eng.prompt_mode() == "chat"
    assert fake_vllm.last.prompts == ["<chat>read it</chat>"]
    (messages, tokenize, gen_prompt), = fake_vllm.last.tok.calls
    assert messages == hunyuan_prompts.template_messages("read it") and tokenize is False and gen_prompt is True


async def test_explicit_modes_and_literal_template(fake_vllm):
    eng = await started("some/model", prompt_template="hunyuan")
    assert fake_vllm.last.prompts[0].endswith(SPOTTING_PROMPT + "<｜hy_User｜>")
    eng = await started("tencent/HunyuanOCR", prompt_template="chat", prompt="p")
    assert fake_vllm.last.prompts == ["<chat>p</chat>"]
    eng = await started("x", prompt_template="<s>{prompt}|{x}</s>", prompt="p")
    assert eng.prompt_mode() == "literal" and fake_vllm.last.prompts == ["<s>p|{x}</s>"]


async def test_chat_mode_without_a_chat_template_is_a_clear_error(fake_vllm):
    fake_vllm.tokenizer_template = None
    with pytest.raises(RuntimeError, match="no chat template; set vllm_prompt_template"):
        await started("Qwen/Qwen2-VL-2B-Instruct")


# --------------------------------------------------------------------------- engine/sampling args


def test_engine_kwargs_and_processor_cache_name_per_version():
    eng = VllmEngine("m", max_num_seqs=32, engine_args={"enforce_eager": True, "load_format": "dummy"})
    kw = eng.engine_kwargs()
    assert kw["enable_prefix_caching"] is False and kw["limit_mm_per_prompt"] == {"image": 1}
    assert kw["mm_processor_cache_gb"] == 0 and kw["max_num_seqs"] == 32
    assert kw["enforce_eager"] is True and kw["load_format"] == "dummy"  # engine_args win
    old = eng.engine_kwargs({"model", "disable_mm_preprocessor_cache"})
    assert old["disable_mm_preprocessor_cache"] is True and "mm_processor_cache_gb" not in old
    neither = eng.engine_kwargs({"model"})
    assert "mm_processor_cache_gb" not in neither and "disable_mm_preprocessor_cache" not in neither


async def test_unsupported_args_are_dropped_with_a_warning(fake_vllm, caplog):
    caplog.set_level(logging.WARNING, logger="services.infer.engines.vllm_engine")
    eng = await started(max_tokens=77, sampling_args={"ignore_eos": True})
    args = fake_vllm.last.args
    assert isinstance(args, EngineArgs) and args.enable_prefix_caching is False and args.mm_processor_cache_gb == 0
    assert args.model == "tencent/HunyuanOCR" and args.limit_mm_per_prompt == {"image": 1}
    assert eng._sampling.kw == {"temperature": 0.0, "max_tokens": 77, "repetition_penalty": 1.0,
                                "skip_special_tokens": True, "ignore_eos": True}
    msgs = [r.getMessage() for r in caplog.records]
    assert any("EngineArgs does not take disable_log_stats" in m for m in msgs), msgs
    assert any("SamplingParams does not take top_k" in m for m in msgs), msgs


def test_supported_args_with_signatures():
    def plain(a, b=1):
        return None

    def open_kw(a, **kw):
        return None

    assert _supported_args(plain, {"a": 1, "c": 3}) == {"a": 1}
    assert _supported_args(open_kw, {"a": 1, "c": 3}) == {"a": 1, "c": 3}


def test_sampling_is_the_recipe_and_settings_reach_the_engine():
    from services.infer.settings import InferSettings

    eng = VllmEngine.from_settings(InferSettings(engine_kind="vllm"))
    assert eng.sampling_kwargs() == {"temperature": 0.0, "top_k": 1, "max_tokens": 4096,
                                     "repetition_penalty": 1.0, "skip_special_tokens": True}
    assert eng.max_side == hunyuan_prompts.VLM_MAX_SIDE == 2048
    eng = VllmEngine.from_settings(InferSettings(engine_kind="vllm", engine_max_side=1536, vllm_max_tokens=99))
    assert eng.max_side == 1536 and eng.sampling_kwargs()["max_tokens"] == 99


def test_a_cache_key_naming_another_model_is_reported(caplog):
    """engine_kind=vllm with engine.model left at the CPU default: the cache key would name
    PP-OCRv6-small while HunyuanOCR is loaded, so a model change would not change the key."""
    from services.common.cache.keys import EngineIdentity
    from services.infer.settings import InferSettings

    with caplog.at_level("WARNING", logger="services.infer.engines.vllm_engine"):
        VllmEngine.from_settings(InferSettings(engine_kind="vllm"))
    assert [r.getMessage() for r in caplog.records] == [
        "vllm: engine.model='PP-OCRv6-small' (the cache key) differs from vllm_model='tencent/HunyuanOCR' (what is loaded)"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="services.infer.engines.vllm_engine"):
        VllmEngine.from_settings(InferSettings(
            engine_kind="vllm", engine=EngineIdentity(engine="vllm", model="tencent/HunyuanOCR", model_revision="r1")))
    assert caplog.records == []


# --------------------------------------------------------------------------- inference


async def test_batch_results_warnings_and_failures(fake_vllm):
    eng = await started()
    ok, cut, boom = await read_all(eng, [page(OK, 2000, 1000), page(LENGTH), page(RAISE)], OCR, timeout_s=10)
    assert isinstance(ok, EngineOutput) and ok.warnings == ()
    assert [(s.text, s.box) for s in ok.segments][0] == (
        "INVOICE", [[200.0, 50.0], [800.0, 50.0], [800.0, 90.0], [200.0, 90.0]])
    assert len(ok.segments) == 3
    assert [s.text for s in cut.segments] == ["INVOICE"] and cut.warnings == ("truncated_max_tokens",)
    assert isinstance(boom, RuntimeError) and str(boom) == "engine core died"
    assert len(fake_vllm.last.aborted) == 1  # the failed request is aborted


async def test_output_tokens_counts_every_generated_token_once(fake_vllm):
    eng = await started()
    before = eng.output_tokens
    assert before == len(ANSWER)  # the warm-up request
    await read_all(eng, [page(OK), page(LENGTH), page(RAISE)], OCR, timeout_s=10)
    assert eng.output_tokens - before == len(ANSWER) + len(CUT)  # the failed request generated none


async def test_an_answer_of_nested_brackets_fails_no_other_image(fake_vllm):
    eng = await started()
    ok, nested, ok2 = await read_all(eng, [page(OK), page(NESTED), page(OK)], OCR, timeout_s=10)
    assert [s.text for s in ok.segments] == [s.text for s in ok2.segments] == ["INVOICE", "发票号码", "TOTAL 97.50"]
    assert isinstance(nested, EngineOutput) and nested.warnings == ("truncated_max_tokens", "unparsed_output")
    assert [(s.text, s.confidence) for s in nested.segments] == [("[" * 5000, 0.0)]  # kept, flagged


async def test_a_parse_failure_is_that_images_error(fake_vllm, monkeypatch):
    eng = await started()
    real = hunyuan.parse_spotting

    def parse(text, *a, **kw):
        if text.startswith("["):
            raise MemoryError("simulated")
        return real(text, *a, **kw)

    monkeypatch.setattr(hunyuan, "parse_spotting", parse)
    ok, nested = await read_all(eng, [page(OK), page(NESTED)], OCR, timeout_s=10)
    assert isinstance(ok, EngineOutput) and len(ok.segments) == 3
    assert isinstance(nested, RuntimeError) and "could not be parsed" in str(nested) and "simulated" in str(nested)


async def test_per_image_timeout_aborts_only_that_request(fake_vllm):
    eng = await started()
    slow, ok = await read_all(eng, [page(SLOW), page(OK)], OCR, timeout_s=0.3)
    assert isinstance(slow, EngineTimeout) and "0.3 s" in str(slow)
    assert isinstance(ok, EngineOutput) and len(ok.segments) == 3
    fake = fake_vllm.last
    assert len(fake.aborted) == 1
    assert fake.chunks_sent[fake.aborted[0]] == 1  # the slow one, stopped in its first chunk


async def test_runaway_loop_is_stopped_early_and_flagged(fake_vllm):
    eng = await started()
    (out,) = await read_all(eng, [page(LOOP)], OCR, timeout_s=10)
    fake = fake_vllm.last
    rid = fake.aborted[0]
    assert fake.aborted == [rid] and fake.chunks_sent[rid] < 60  # of 1000 it would have sent
    assert out.warnings == ("truncated_repetition",)
    assert [s.text for s in out.segments] == ["Title", "重复"]


async def test_forms_leaders_and_long_numbers_run_to_the_end(fake_vllm):
    eng = await started()
    (out,) = await read_all(eng, [page(FORM)], OCR, timeout_s=10)
    assert fake_vllm.last.aborted == [] and out.warnings == ()
    assert [s.text for s in out.segments] == [
        "Signature: " + "_" * 300, "Total 1" + "0" * 300, "Chapter 1 " + "." * 400 + " 5",
        "Chapter 2 " + " ".join(["."] * 200) + " 9",
    ]


async def test_repeat_stop_off_lets_the_loop_run(fake_vllm):
    eng = await started(repeat_stop=False)
    (out,) = await read_all(eng, [page(LOOP)], OCR, timeout_s=10)
    # ran to the cap; the parser still trims the loop, and the page is flagged
    assert fake_vllm.last.aborted == [] and out.warnings == ("truncated_max_tokens", "truncated_repetition")
    assert [s.text for s in out.segments] == ["Title", "重复"]


async def test_the_lane_is_the_requests_priority_under_the_priority_policy(fake_vllm):
    eng = await started()  # scheduling_policy "priority", the default
    assert fake_vllm.last.args.scheduling_policy == "priority"
    fake_vllm.last.priorities.clear()
    await eng.page(page(OK), OCR, timeout_s=10, lane="interactive")
    await eng.page(page(OK), OCR, timeout_s=10, lane="bulk")
    assert fake_vllm.last.priorities == [0, 1]  # vLLM admits the lower first
    fcfs = await started(scheduling_policy="fcfs")
    fake_vllm.last.priorities.clear()
    await fcfs.page(page(OK), OCR, timeout_s=10, lane="bulk")
    assert fake_vllm.last.priorities == [0]  # not passed: vLLM refuses a priority under fcfs
    assert fcfs.slots == 2 * fcfs.max_num_seqs and fcfs.busy == 0


async def test_a_page_before_start_is_an_error():
    with pytest.raises(RuntimeError, match="not started"):
        await VllmEngine("m").page(page(OK), OCR, timeout_s=1)


async def test_old_vllm_without_v1_falls_back_to_async_llm_engine(fake_vllm, monkeypatch):
    for name in ("vllm.v1", "vllm.v1.engine", "vllm.v1.engine.async_llm"):
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys.modules["vllm"], "__path__", None, raising=False)
    monkeypatch.setattr(sys.modules["vllm"], "AsyncLLMEngine", FakeAsyncLLM, raising=False)
    eng = await started()
    assert eng.ready and fake_vllm.last is not None


# --------------------------------------------------------------------------- device


def test_select_device_one_process_per_gpu():
    env: dict[str, str] = {}
    assert select_device("cuda:1", env) == "1" and env == {"CUDA_VISIBLE_DEVICES": "1"}
    env = {"CUDA_VISIBLE_DEVICES": "4, 5,6"}  # set by the orchestrator: N indexes into it
    assert select_device("cuda:1", env) == "5" and env["CUDA_VISIBLE_DEVICES"] == "5"
    env = {"CUDA_VISIBLE_DEVICES": "3"}
    with pytest.raises(ValueError, match="has only 1 GPU"):
        select_device("cuda:2", env)
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert select_device("cpu", env) == "2,3" and select_device("cuda", env) == "2,3"
    assert select_device("cpu", {}) is None
    env = {"CUDA_VISIBLE_DEVICES": ""}
    assert select_device("CUDA:0", env) == "0"


async def test_a_dead_engine_core_is_not_ready_and_commits_nothing(fake_vllm):
    eng = await started()
    assert eng.ready and await eng.health()
    with pytest.raises(EngineUnavailable, match="engine core dead") as err:
        await read_all(eng, [page(OK), page(DIE)], OCR, timeout_s=10)
    assert is_transient(err.value) and not eng.ready and await eng.health() is False
    with pytest.raises(EngineUnavailable):  # a failing image on a dead engine: still not its fault
        await read_all(eng, [page(RAISE)], OCR, timeout_s=10)


async def test_health_notices_a_core_that_died_between_batches(fake_vllm):
    eng = await started()
    fake_vllm.last.errored = True
    assert await eng.health() is False and not eng.ready
