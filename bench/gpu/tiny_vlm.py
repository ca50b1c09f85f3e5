"""Build a tiny, randomly initialised Qwen2-VL checkpoint locally (no download) for GPU smoke
tests and batching benchmarks: 2 text layers (hidden 256, head dim 64), a 2-layer vision tower,
a byte-level BPE tokenizer trained here on a few strings, and the Qwen2-VL processor configs.

Usage: python bench/gpu/tiny_vlm.py OUT_DIR
Prints one line ``load_format=auto`` (weights saved) or ``load_format=dummy`` (config only; vLLM
then initialises random weights itself).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.common.cache.prompts import SPOTTING_PROMPT  # noqa: E402 - after the repository root is on the path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    SPOTTING_PROMPT,  # the default prompt the VLM engines send
    "INVOICE No. 4821 TOTAL 97.50 EUR(100,50),(400,90)",
    "The quick brown fox jumps over the lazy dog 0123456789",
    "发票号码 金额(小写) 日期 2024-01-31 合计 ¥1,234.56",
    "system user assistant You are a helpful assistant.",
] * 20
MIN_PIXELS = 4 * 28 * 28
MAX_PIXELS = 2048 * 28 * 28  # a 896x1152 page is ~1,300 image tokens


def _wrap_fast(tok):
    """``tok`` (a ``tokenizers.Tokenizer``) as a transformers fast tokenizer. transformers 4.x
    takes the extra special tokens as ``additional_special_tokens``; 5.x renamed them
    ``extra_special_tokens`` and may refuse the old name: each spelling is tried, then none (the
    specials are already special tokens of ``tok``)."""
    from transformers import PreTrainedTokenizerFast

    base = dict(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    errors = []
    for extra in ({"additional_special_tokens": SPECIALS[1:]}, {"extra_special_tokens": SPECIALS[1:]}, {}):
        try:
            return PreTrainedTokenizerFast(**base, **extra)
        except Exception as exc:  # TypeError/ValueError/AttributeError across versions
            errors.append(f"{next(iter(extra), 'no extras')}: {exc!r}")
    raise RuntimeError("PreTrainedTokenizerFast refused every spelling: " + "; ".join(errors))


def _write_tokenizer_by_hand(out: Path, tok) -> None:
    """tokenizer.json (the ``tokenizers`` library's own format) and a minimal
    tokenizer_config.json, which AutoTokenizer (and so vLLM) loads as PreTrainedTokenizerFast."""
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": 8192, "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def build_tokenizer(out: Path):
    """Train a 640-token byte-level BPE on :data:`CORPUS` and save it under ``out`` as a
    transformers fast tokenizer with :data:`CHAT_TEMPLATE`.

    Returns:
        ``(tokenizer, vocab_size, {special token: id})``.

    Raises:
        RuntimeError: the ``tokenizers``/``transformers`` packages are missing, or this
            transformers version can neither wrap nor load the tokenizer (message names it).
    """
    try:
        import transformers
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as exc:
        raise RuntimeError(f"tiny_vlm: needs the tokenizers and transformers packages ({exc})") from exc

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=640, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(out))  # vocab.json + merges.txt, for slow/Qwen2 tokenizer classes
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    try:
        fast = _wrap_fast(tok)
        fast.chat_template = CHAT_TEMPLATE
        fast.model_max_length = 8192
        fast.save_pretrained(str(out))
        print(f"tokenizer: saved with transformers {transformers.__version__}")
    except Exception as exc:
        print(f"tokenizer: transformers {transformers.__version__} could not save it ({exc!r}); "
              "writing tokenizer.json + tokenizer_config.json by hand")
        _write_tokenizer_by_hand(out, tok)
        try:
            from transformers import AutoTokenizer

            fast = AutoTokenizer.from_pretrained(str(out))
        except Exception as exc2:
            raise RuntimeError(f"tiny_vlm: transformers {transformers.__version__} cannot load the tokenizer "
                               f"written to {out}: {exc2!r}") from exc2
    check = fast("INVOICE 97.50")["input_ids"]
    if not check or max(check) >= tok.get_vocab_size():
        raise RuntimeError(f"tiny_vlm: tokenizer round trip gave ids {check} (vocab {tok.get_vocab_size()})")
    print(f"tokenizer: {tok.get_vocab_size()} tokens, specials {ids}")
    return fast, tok.get_vocab_size(), ids


def build_processor(out: Path, fast) -> None:
    try:
        from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor

        ip = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
        kwargs = dict(image_processor=ip, tokenizer=fast, chat_template=CHAT_TEMPLATE)
        try:
            from transformers import Qwen2VLVideoProcessor

            kwargs["video_processor"] = Qwen2VLVideoProcessor()
        except Exception as exc:  # older transformers: no video processor class
            print(f"processor: no Qwen2VLVideoProcessor ({exc.__class__.__name__}); continuing without")
        Qwen2VLProcessor(**kwargs).save_pretrained(str(out))
        print("processor: saved with transformers")
    except Exception as exc:
        print(f"processor: transformers failed ({exc!r}); writing preprocessor_config.json by hand")
        (out / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
            "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "patch_size": 14, "merge_size": 2,
            "temporal_patch_size": 2, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "do_convert_rgb": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        }, indent=1))
    # keep the pixel limits in preprocessor_config.json whatever the transformers version wrote
    cfg_path = out / "preprocessor_config.json"
    if cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
        cfg.update(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
        if isinstance(cfg.get("size"), dict):
            cfg["size"] = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
        cfg_path.write_text(json.dumps(cfg, indent=1))


def model_config(vocab: int, ids: dict) -> tuple[dict, dict, dict]:
    text = dict(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True,
                rope_scaling={"type": "mrope", "rope_type": "default", "mrope_section": [8, 12, 12]},
                use_sliding_window=False, attention_dropout=0.0)
    vision = dict(depth=2, embed_dim=128, hidden_size=256, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, hidden_act="quick_gelu")
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                  pad_token_id=ids["<|endoftext|>"])
    return text, vision, tokens


def build_model(out: Path, vocab: int, ids: dict) -> str:
    text, vision, tokens = model_config(vocab, ids)
    flat = dict(architectures=["Qwen2VLForConditionalGeneration"], model_type="qwen2_vl", torch_dtype="bfloat16",
                **text, vision_config=vision, **tokens)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tokens["bos_token_id"], "eos_token_id": tokens["eos_token_id"],
         "pad_token_id": tokens["pad_token_id"], "do_sample": False}, indent=1))
    try:
        import torch
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        cfg = Qwen2VLConfig(text_config=dict(text, **tokens), vision_config=vision, **tokens)
        hidden = getattr(getattr(cfg, "text_config", None), "hidden_size", None)
        if hidden != 256:  # older transformers: flat text fields
            cfg = Qwen2VLConfig(**{k: v for k, v in flat.items() if k not in ("architectures", "model_type")})
        assert getattr(cfg, "text_config", cfg).hidden_size == 256, "tiny config not applied"
        cfg.architectures = ["Qwen2VLForConditionalGeneration"]
        torch.manual_seed(0)
        model = Qwen2VLForConditionalGeneration(cfg).to(torch.bfloat16)
        n = sum(p.numel() for p in model.parameters())
        model.save_pretrained(str(out), safe_serialization=True)
        print(f"model: {n / 1e6:.2f} M parameters, saved with transformers")
        return "auto"
    except Exception as exc:
        print(f"model: transformers could not build it ({exc!r}); config only, vLLM load_format=dummy")
        (out / "config.json").write_text(json.dumps(flat, indent=1))
        return "dummy"


def main() -> None:
    out = Path(sys.argv[1])
    try:
        fast, vocab, ids = build_tokenizer(out)
    except RuntimeError as exc:
        sys.exit(str(exc))
    build_processor(out, fast)
    fmt = build_model(out, vocab, ids)
    print(f"load_format={fmt}")


if __name__ == "__main__":
    main()
