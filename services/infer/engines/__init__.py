"""OCR engines behind one interface: ``rapidocr`` (CPU, default), ``vllm`` and ``openai`` (GPU extra)."""
