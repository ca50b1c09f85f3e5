"""The CPU engine never reaches the network: its models (PP-OCRv6 from rapidocr 3.10.0, the
PP-OCRv4 engine before it, the layout and table models) load from their wheels with every
socket refused, and rapidocr's downloader fails loudly if anything calls it."""

import json
import subprocess
import sys
import textwrap

from tests.conftest import text_image

SCRIPT = textwrap.dedent("""
    import asyncio, io, json, socket, sys

    tried = []

    def refuse(*args, **kwargs):
        tried.append(repr(args[1:] if args and isinstance(args[0], socket.socket) else args)[:200])
        raise OSError("network refused by the test")

    # before anything is imported: every connection and every name lookup fails, and is recorded
    socket.socket.connect = refuse
    socket.socket.connect_ex = refuse
    socket.create_connection = refuse
    socket.getaddrinfo = refuse

    import numpy as np
    from PIL import Image

    from services.infer.engines import rapid_models
    from services.infer.engines.base import EngineTask
    from services.infer.engines.rapid import RapidOcrEngine

    page = np.asarray(Image.open(io.BytesIO(sys.stdin.buffer.read())).convert("RGB"))

    async def main():
        out = {}
        engine = RapidOcrEngine()  # PP-OCRv6-small: start() reads a warm-up page with ocr and doc_parse
        await engine.start()
        for task in ("ocr", "doc_parse", "table"):
            res = await engine.page(page, EngineTask(task), 120)
            out[task] = [s.text for s in res.segments] if task == "ocr" else res.answer
        await engine.close()
        legacy = rapid_models.load("PP-OCRv4-ch", threads=1, max_side=2000, det_limit_side_len=736)
        out["legacy"] = [r.text for r in legacy(page)]
        from rapidocr.utils.download_file import DownloadFile, DownloadFileInput
        try:
            DownloadFile.run(DownloadFileInput("https://example.com/m.onnx", "/tmp/never.onnx", None))
        except RuntimeError as exc:
            out["download"] = str(exc)
        out["tried"] = tried
        print("RESULT " + json.dumps(out))

    asyncio.run(main())
""")


def test_the_engine_reads_pages_with_every_socket_refused():
    """ocr, doc_parse and table on PP-OCRv6, and ocr on PP-OCRv4, in a fresh process whose
    sockets cannot connect or resolve a name: the answers come and no connection was tried."""
    image = text_image(["OFFLINE CHECK 2026"])
    proc = subprocess.run([sys.executable, "-c", SCRIPT], input=image, capture_output=True, timeout=600)
    lines = [ln for ln in proc.stdout.decode().splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr.decode()[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["tried"] == []
    # PP-OCRv6's detector boxes each word (docs/lines.md), PP-OCRv4's the line
    assert " ".join(out["ocr"]) == "OFFLINE CHECK 2026" and out["legacy"] == ["OFFLINE CHECK 2026"]
    assert "OFFLINE CHECK 2026" in out["doc_parse"] and out["table"] == ""  # no table region: none made up
    assert out["download"].startswith("rapidocr tried to download https://example.com/m.onnx")
