"""What is sent to HunyuanOCR: the prompt's wrapping (chat messages, vLLM's raw template), the
image as the model takes it, and the sampling. Its answers are parsed in
:mod:`services.infer.engines.hunyuan`.

The instructions themselves (:data:`~services.common.cache.prompts.SPOTTING_PROMPT`, ...) are in
:mod:`services.common.cache.prompts`: a prompt is part of the cache key, which dedup and the HTTP door
compute too.

Nothing here needs vLLM, torch or a network.
"""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image

from services.common.cache.prompts import SPOTTING_PROMPT
from services.common.cache.keys import VLM_MAX_SIDE as COMMON_VLM_MAX_SIDE

#: Raw prompt for in-process vLLM (no chat template), as in vLLM's own HunyuanOCR example
#: (``examples/offline_inference/vision_language.py``, ``run_hunyuan_vl``): BOS, the image
#: placeholder tokens, the instruction, then the user/assistant turn marker.
HUNYUAN_RAW_TEMPLATE = (
    "<｜hy_begin▁of▁sentence｜><｜hy_place▁holder▁no▁100｜><｜hy_place▁holder▁no▁102｜>"
    "<｜hy_place▁holder▁no▁101｜>{prompt}<｜hy_User｜>"
)
#: Sampling of vLLM's HunyuanOCR recipe (vllm-project/recipes, ``Tencent-Hunyuan/HunyuanOCR.md``,
#: "Querying with OpenAI API Client"): ``temperature=0.0`` with ``extra_body={"top_k": 1,
#: "repetition_penalty": 1.0}``, i.e. greedy decoding and no repetition penalty. A penalty
#: above 1.0 lowers the odds of digits and punctuation a page really repeats; loops are
#: caught by the repeat guard (:func:`services.infer.engines.hunyuan.find_tail_loop`) and
#: ``max_tokens`` instead.
DEFAULT_REPETITION_PENALTY = 1.0
#: ``top_k`` of the same recipe (greedy).
DEFAULT_TOP_K = 1
#: Longest image side (px) the VLM engines are handed by default (``engine_max_side``
#: overrides it; defined in the shared settings because it is part of the cache key). The
#: model's own processor resizes to its pixel budget in any case; beyond about 2K px a page
#: costs more image tokens (a 2048 px page is about 4,100) for no gain in legibility at
#: ordinary print sizes, and very long pages are tiled rather than shrunk.
VLM_MAX_SIDE = COMMON_VLM_MAX_SIDE


def pad_for_vlm(image: np.ndarray, min_side: int = 32, max_aspect: float = 150.0) -> np.ndarray:
    """Pad with white on the right/bottom so the image is at least ``min_side`` on each side and
    at most ``max_aspect`` long/short (vLLM's processors reject tiny sides and aspect ratios over
    200). Padding right/bottom keeps the original pixels at the same coordinates.

    Returns the image itself when nothing is needed.
    """
    h, w = image.shape[:2]
    nh, nw = max(h, min_side), max(w, min_side)
    if nw > max_aspect * nh:
        nh = int(np.ceil(nw / max_aspect))
    elif nh > max_aspect * nw:
        nw = int(np.ceil(nh / max_aspect))
    if (nh, nw) == (h, w):
        return image
    out = np.full((nh, nw, 3), 255, dtype=np.uint8)
    out[:h, :w] = image[..., :3]
    return out


def encode_data_url(image: np.ndarray, fmt: str = "png", quality: int = 95) -> str:
    """An RGB ``uint8`` array as a ``data:`` URL (PNG is lossless; JPEG is smaller)."""
    buf = io.BytesIO()
    pil = Image.fromarray(np.ascontiguousarray(image[..., :3], dtype=np.uint8))
    if fmt.lower() in ("jpg", "jpeg"):
        pil.save(buf, format="JPEG", quality=quality)
        mime = "image/jpeg"
    else:
        pil.save(buf, format="PNG", compress_level=1)
        mime = "image/png"
    return f"data:{mime};base64,{base64.b64encode(buf.getvalue()).decode('ascii')}"


def chat_messages(image_url: str, prompt: str = SPOTTING_PROMPT) -> list[dict]:
    """OpenAI chat-completions messages as HunyuanOCR's own clients send them: an empty system
    message, then one user turn with the image first and the instruction after it."""
    return [
        {"role": "system", "content": ""},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_url}},
                {"type": "text", "text": prompt},
            ],
        },
    ]


def build_messages(image: np.ndarray, prompt: str = SPOTTING_PROMPT, fmt: str = "png") -> list[dict]:
    """Chat-completions messages with ``image`` inline as a base64 data URL."""
    return chat_messages(encode_data_url(image, fmt), prompt)


def template_messages(prompt: str = SPOTTING_PROMPT) -> list[dict]:
    """Messages for a Hugging Face chat template (``apply_chat_template``): the image is a
    ``{"type": "image"}`` placeholder; vLLM receives the pixels as ``multi_modal_data``."""
    return [
        {"role": "system", "content": ""},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]},
    ]


def render_template(template: str, prompt: str) -> str:
    """``template`` with ``{prompt}`` replaced (plain replacement: templates hold braces-free
    special tokens, but this never interprets other braces)."""
    return template.replace("{prompt}", prompt)
