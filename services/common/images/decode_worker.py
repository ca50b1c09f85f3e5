"""The decoder process: ``python -m services.common.images.decode_worker FD MEMORY_BYTES``.

Started by :class:`services.common.images.decoding.DecoderPool`, never by hand. It reads requests from
the ``SOCK_SEQPACKET`` socket ``FD`` (one datagram each: JSON, with the input and output files
passed as descriptors, ``SCM_RIGHTS``), runs the in-process functions of
:mod:`services.common.images.imaging` on them and answers with one JSON datagram per step. Its address
space is capped at ``MEMORY_BYTES`` (``RLIMIT_AS``; 0 = no cap) after its imports, it is the
first process the kernel kills when its container runs out of memory (``oom_score_adj`` 1000),
and it is killed with its parent (``PR_SET_PDEATHSIG``), so a render the parent gave up on never
outlives it.

Requests (``op``) and answers:

* ``sniff`` (fds: input): ``{"info": [format, width, height, frames]}``.
* ``plan`` (fds: input): ``{"info": [...], "sizes": [[w, h], ...]}`` (upright, per page).
* ``decode`` (fds: input, output; ``sizes`` and byte ``offsets`` from the plan): every page is
  written as RGB ``uint8`` rows into the output file at its offset (``pwrite``, no pickling,
  no copy through the socket), then ``{"page": i, "size": [w, h], "background": b}`` (``size``:
  as planned, or with its sides swapped by the EXIF orientation) (``b``: the colour the
  page's transparency was flattened onto, ``"white"``/``"black"``, or null for an opaque page:
  :func:`~services.common.images.imaging.iter_flattened`); ``{"done": n}`` after the last one.
* ``doc_plan`` (fds: input; ``max_document_pages``, ``max_document_pixels``): as ``plan``, a PDF
  or TIFF checked against the document limits (:func:`~services.common.documents.splitting.document_plan`).
* ``render`` (fds: input, output; ``first``, ``count``): pages of a PDF or TIFF as PNG
  (:func:`~services.common.documents.splitting.render_pages`), appended to the output file one after the
  other, each announced ``{"page": i, "offset": o, "length": n, "size": [w, h]}``, or, for a page
  that alone cannot be rendered, ``{"page": i, "failed": code, "message": text}``; then ``{"done": k}``.
* any failure: ``{"error": code, "message": text}`` (an :class:`OcrError`'s code;
  ``image_too_complex`` for a ``MemoryError``; ``internal_error`` for anything else).

The first datagram it sends is ``{"ready": pid}``, once its imports and limits are in place.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import socket
import sys


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (prctl(2) ``PR_SET_PDEATHSIG`` = 1)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent's close() still kills it
        pass


def _first_to_go() -> None:
    """Offer this process first when its container runs out of memory (``oom_score_adj`` 1000,
    proc(5)): the kernel then kills the decoder, whose image ends ``image_too_complex``, not the
    stage."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


TRIM_ABOVE_BYTES = 512 << 20
"""After a request, freed heap is given back to the system only when the process holds more than
this (a large image): below it the next image reuses it, instead of faulting in fresh pages (an
A4 JPEG decodes in 11 ms with its pages reused, 35 ms without; ``bench/decode_bench.py``)."""


def _malloc_trim() -> None:
    """Give freed heap pages back to the system after a large image (glibc ``malloc_trim(0)``)."""
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        if rss > TRIM_ABOVE_BYTES:
            ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, ValueError):
        pass


def _send(sock: socket.socket, obj: dict) -> None:
    import orjson

    sock.send(orjson.dumps(obj))


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    while buf:
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


def _serve(sock: socket.socket, req: dict, fds: list[int]) -> None:
    from services.common.images import imaging
    from services.common.errors import OcrError
    from schemas.errors import ErrorCode

    op = req["op"]
    px, pages = int(req["max_pixels"]), int(req["max_pages"])
    with open(f"/proc/self/fd/{fds[0]}", "rb") as src:  # an offset of its own, whoever else holds the file
        if op == "sniff":
            info = imaging.sniff(src, px, pages)
            _send(sock, {"info": [info.format, info.width, info.height, info.frames]})
        elif op == "plan":
            info, sizes = imaging.page_sizes(src, px, pages)
            _send(sock, {"info": [info.format, info.width, info.height, info.frames], "sizes": sizes})
        elif op == "decode":
            sizes, offsets, out = req["sizes"], req["offsets"], fds[1]
            n = 0
            for i, (page, background) in enumerate(imaging.iter_flattened(src, px, pages)):
                h, w = page.shape[:2]
                # as planned, or turned a quarter by its EXIF orientation: the same bytes either way
                if i >= len(sizes) or sorted((w, h)) != sorted(sizes[i]):
                    want = f"{sizes[i][0]}x{sizes[i][1]}" if i < len(sizes) else "no such page"
                    raise OcrError(ErrorCode.CORRUPT_IMAGE, f"page {i + 1} decodes to {w}x{h}, its header said {want}")
                _pwrite_all(out, memoryview(page.reshape(-1)).cast("B"), int(offsets[i]))
                del page
                _send(sock, {"page": i, "size": [w, h], "background": background})
                n = i + 1
            if n != len(sizes):
                raise OcrError(ErrorCode.CORRUPT_IMAGE, f"the image decodes to {n} pages, its header said {len(sizes)}")
            _send(sock, {"done": n})
        elif op in ("doc_plan", "render"):
            _serve_document(sock, op, req, src, fds, px, pages)
        else:
            raise ValueError(f"unknown op {op!r}")


def _serve_document(sock: socket.socket, op: str, req: dict, src, fds: list[int], px: int, pages: int) -> None:
    from services.common.documents import splitting
    from services.common.errors import OcrError

    if op == "doc_plan":
        info, sizes = splitting.document_plan(src, px, pages, int(req["max_document_pages"]),
                                              int(req["max_document_pixels"]))
        _send(sock, {"info": [info.format, info.width, info.height, info.frames], "sizes": sizes})
        return
    at, n = 0, 0
    for i, page in enumerate(splitting.render_pages(src, int(req["first"]), int(req["count"]), px)):
        n = i + 1
        if isinstance(page, OcrError):  # this page alone cannot be rendered
            _send(sock, {"page": i, "failed": page.code.value, "message": page.message[:2000]})
            continue
        png, w, h = page
        _pwrite_all(fds[1], memoryview(png), at)
        _send(sock, {"page": i, "offset": at, "length": len(png), "size": [w, h]})
        at += len(png)
    _send(sock, {"done": n})


def main() -> int:
    """Serve requests until the socket closes (the parent went away or closed the pool)."""
    fd, memory = int(sys.argv[1]), int(sys.argv[2])
    _die_with_parent()
    _first_to_go()
    sock = socket.socket(fileno=fd)
    import numpy  # noqa: F401 - imported before the address space is capped
    import orjson
    import pypdfium2  # noqa: F401
    from PIL import Image  # noqa: F401

    from schemas.errors import ErrorCode
    from services.common.images import imaging
    from services.common.documents import splitting  # noqa: F401
    from services.common.errors import OcrError

    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    _send(sock, {"ready": os.getpid()})
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 65536, 4)
        except (ConnectionError, OSError):
            return 0
        if not msg:
            return 0
        try:
            _serve(sock, orjson.loads(msg), fds)
        except OcrError as exc:
            _send(sock, {"error": exc.code.value, "message": exc.message[:2000]})
        except MemoryError:
            _send(sock, {"error": ErrorCode.IMAGE_TOO_COMPLEX.value,
                         "message": f"decoding needs more memory than the decoder's limit of {memory >> 20} MiB"})
        except Exception as exc:  # noqa: BLE001 - a bug or a decoder failure outside our checks
            _send(sock, {"error": ErrorCode.INTERNAL_ERROR.value, "message": f"{type(exc).__name__}: {exc}"[:2000]})
        finally:
            for f in fds:
                try:
                    os.close(f)
                except OSError:
                    pass
            _malloc_trim()


if __name__ == "__main__":
    sys.exit(main())
