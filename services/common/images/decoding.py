"""Decoding in killable worker processes: hard time and memory bounds, pixels in shared memory.

A thread cannot be stopped, and a hostile file can make a decoder or a PDF renderer work without
end (form XObjects that each draw the next one ten times: 10^6 draws for a 3 KB file) or grow
without bound. So every format check, decode and render of the stages runs in a decoder process
(:mod:`services.common.images.decode_worker`) of a small pool:

* **time**: each page (and the format check) has ``decode.page_timeout_s``, all pages of one
  request ``decode.timeout_s``; past either the process is killed (SIGKILL) and replaced, and
  the request ends ``decode_timeout``;
* **memory**: each process has an address-space cap (``decode.memory_mb``, ``RLIMIT_AS``); an
  image that needs more ends ``image_too_complex`` (a ``MemoryError``, or the process dying);
* **pixels in flight**: a stage that holds many decoded pages at once (infer) takes each
  request's bytes from a :class:`~services.common.images.pixel_budget.PixelBudget` before decoding it, so its memory for pixels is
  bounded whatever the mix of images.

Hand-over without copies: the parent puts the input in a ``memfd`` (or passes the spool file of
a large upload as it is) and creates the output ``memfd`` of exactly the planned size; both go
to the worker as descriptors over a ``SOCK_SEQPACKET`` socket (``SCM_RIGHTS``). The worker writes
each page's RGB rows into the output with ``pwrite``; the parent maps it and hands out numpy
views of it (:class:`DecodedPages`): no pixel is pickled or copied through a pipe.

Decoding is two steps, so memory is set aside before any pixel exists: :meth:`DecoderPool.plan`
(format check and every page's upright size, from the headers) then :meth:`DecoderPool.decode`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np
import orjson
from opentelemetry import trace

from schemas.errors import ErrorCode
from services.common.errors import OcrError, OcrstreamError
from services.common.images.imaging import BACKGROUNDS, ImageInfo
from services.common.settings import DecodeSettings, Limits
from services.common.documents.splitting import Rendered

log = logging.getLogger(__name__)

_ALIGN = 64
"""Byte alignment of each page inside the output buffer (a cache line: aligned numpy rows)."""


@dataclass(frozen=True)
class Plan:
    """What decoding one image will produce: its header ``info`` and every page's upright
    ``(width, height)`` in pixels, laid out at ``offsets`` (bytes) in one buffer of ``nbytes``."""

    info: ImageInfo
    sizes: tuple[tuple[int, int], ...]
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, info: ImageInfo, sizes: list[tuple[int, int]]) -> "Plan":
        """Lay the pages out one after the other, each 3 bytes per pixel (RGB), 64-byte aligned."""
        offsets, at = [], 0
        for w, h in sizes:
            offsets.append(at)
            at += -(-(w * h * 3) // _ALIGN) * _ALIGN
        return cls(info, tuple((int(w), int(h)) for w, h in sizes), tuple(offsets), at)


class DecodedPages:
    """The pages of one image, as read-only-by-convention numpy views of one shared buffer.

    ``pages[i]`` has shape ``(height, width, 3)``, ``uint8``. The mapping is private
    (copy-on-write), so writing into a page changes nothing another holder sees. Call
    :meth:`release` when done: the pages are dropped and the bytes given back to the budget they
    were taken from (the memory itself is freed when the last view goes).

    ``sizes[i]`` is page ``i``'s ``(width, height)`` as decoded (upright: the plan's, or with the
    sides swapped by page 1's EXIF orientation); it stays after :meth:`release`.
    ``backgrounds[i]`` is the colour page ``i``'s transparency was flattened onto (``"white"``
    or ``"black"``), None for an opaque page (:func:`services.common.images.imaging.flatten`); it
    stays after :meth:`release`.
    """

    def __init__(self, plan: Plan, buf: mmap.mmap | None, on_release: Callable[[], None] | None = None,
                 backgrounds: tuple[str | None, ...] = (), sizes: tuple[tuple[int, int], ...] = ()):
        self.plan = plan
        self.backgrounds = backgrounds or (None,) * len(plan.sizes)
        self.sizes = sizes or plan.sizes  # as decoded: page 1 upright by its EXIF orientation
        self._buf = buf
        self._on_release = on_release
        self.pages: list[np.ndarray] = []
        if buf is not None:
            for (w, h), off in zip(self.sizes, plan.offsets):
                self.pages.append(np.frombuffer(buf, dtype=np.uint8, count=w * h * 3, offset=off).reshape(h, w, 3))

    @property
    def nbytes(self) -> int:
        """Bytes of pixels held (the plan's buffer size)."""
        return self.plan.nbytes

    def release(self) -> None:
        """Drop the pages and give their bytes back (idempotent)."""
        self.pages = []
        self._buf = None
        cb, self._on_release = self._on_release, None
        if cb is not None:
            cb()


class _Died(OcrstreamError):
    """The worker process ended (exit status or signal in ``returncode``)."""

    def __init__(self, returncode: int | None):
        super().__init__(returncode)
        self.returncode = returncode


@dataclass(eq=False)
class _Worker:
    """One decoder process and the parent's end of its socket."""

    proc: subprocess.Popen
    sock: socket.socket
    ready: bool = False
    jobs: int = field(default=0)

    @classmethod
    def spawn(cls, cfg: DecodeSettings) -> "_Worker":
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   # glibc: pages up to 128 MiB come from the heap and freed heap is kept for the next
                   # image (mallopt(3) M_MMAP_THRESHOLD, M_TRIM_THRESHOLD): no fresh page faults for
                   # every image; the worker trims itself after a large one (decode_worker.TRIM_ABOVE_BYTES)
                   MALLOC_MMAP_THRESHOLD_=str(128 << 20), MALLOC_TRIM_THRESHOLD_=str(512 << 20))
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.common.images.decode_worker", str(theirs.fileno()), str(cfg.memory_mb << 20)],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        ours.setblocking(False)
        return cls(proc, ours)

    async def recv(self, timeout: float) -> dict:
        """The next answer, within ``timeout`` seconds.

        Raises:
            asyncio.TimeoutError: none came in time.
            _Died: the process ended.
        """
        loop = asyncio.get_running_loop()
        try:
            data = await asyncio.wait_for(loop.sock_recv(self.sock, 65536), max(0.0, timeout))
        except asyncio.TimeoutError:  # (an OSError since Python 3.11: caught first)
            raise
        except (ConnectionError, OSError):
            data = b""
        if not data:
            raise _Died(await self.reap())
        return orjson.loads(data)

    def send(self, msg: dict, fds: list[int]) -> None:
        """One request with its descriptors (a small datagram: never blocks for long)."""
        socket.send_fds(self.sock, [orjson.dumps(msg)], fds)

    async def reap(self) -> int | None:
        """Wait (briefly) for the process to end; its return code."""
        for _ in range(100):
            code = self.proc.poll()
            if code is not None:
                return code
            await asyncio.sleep(0.01)
        return self.proc.poll()

    def kill(self) -> None:
        """SIGKILL the process and close the socket (it is reaped by :meth:`reap` or at exit)."""
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.sock.close()


def _memfd_with(data: bytes | bytearray | memoryview) -> int:
    """A new memfd holding ``data`` (one kernel copy), positioned at 0."""
    fd = os.memfd_create("ocrstream-image", os.MFD_CLOEXEC)
    view = memoryview(data).cast("B")
    try:
        at = 0
        while at < len(view):
            at += os.pwrite(fd, view[at:], at)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _input_fd(src: bytes | BinaryIO) -> int:
    """A descriptor the worker can read the input from (the caller closes it)."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        return _memfd_with(src)
    try:
        fileno = src.fileno()
    except (AttributeError, OSError, ValueError):
        src.seek(0)
        return _memfd_with(src.read())
    if hasattr(src, "flush"):
        src.flush()
    return os.dup(fileno)


def _signal_name(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


class DecoderStopped(OcrError):
    """A page's error when the decoder process was stopped over it (``decode_timeout``) or died on
    it (``image_too_complex``): :meth:`DecoderPool.render_pages`."""


class DecoderPool:
    """A pool of decoder processes; every call is bounded in time and memory (module docstring).

    Args:
        cfg: Worker count, memory cap, time limits.
        limits: Pixel and page limits handed to every check.

    Use ``await start()`` (or the first call starts workers) and ``await close()``.
    """

    def __init__(self, cfg: DecodeSettings, limits: Limits):
        self.cfg = cfg
        self.limits = limits
        self._slots: asyncio.Queue[_Worker | None] | None = None
        self._all: set[_Worker] = set()
        self.restarts: collections.Counter[str] = collections.Counter()  # reason -> workers replaced

    async def start(self) -> None:
        """Start the worker processes (idempotent); each is ready once it has sent ``ready``."""
        if self._slots is not None:
            return
        self._slots = asyncio.Queue()
        for _ in range(self.cfg.workers):
            self._slots.put_nowait(self._spawn())

    def _spawn(self) -> _Worker:
        w = _Worker.spawn(self.cfg)
        self._all.add(w)
        return w

    async def close(self) -> None:
        """Kill every worker process."""
        for w in list(self._all):
            w.kill()
        for w in list(self._all):
            await w.reap()
        self._all.clear()
        self._slots = None

    async def _take(self) -> _Worker:
        if self._slots is None:
            await self.start()
        assert self._slots is not None
        w = await self._slots.get()
        try:
            if w is None or w.proc.poll() is not None:
                if w is not None:
                    self._drop(w, "exited")
                w = self._spawn()
            if not w.ready:
                msg = await w.recv(self.cfg.start_timeout_s)
                if "ready" not in msg:
                    raise RuntimeError(f"decoder process sent {msg!r} before it was ready")
                w.ready = True
        except BaseException:
            if w is not None:
                self._drop(w, "start")
            self._slots.put_nowait(None)
            raise
        return w

    def _give_back(self, w: _Worker | None) -> None:
        if self._slots is not None:
            self._slots.put_nowait(w)

    def _drop(self, w: _Worker, reason: str) -> None:
        w.kill()
        self._all.discard(w)
        self.restarts[reason] += 1
        if reason != "cancelled":
            log.warning("decoder process %d stopped (%s); a new one takes its place", w.proc.pid, reason)

    async def _call(self, msg: dict, fds: list[int], *, on_step: Callable[[dict], None] | None = None,
                    timeout_s: float | None = None) -> dict:
        """Send ``msg`` to a free worker and read its answers until a final one.

        Each answer must come within ``decode.page_timeout_s`` of the previous, all of them within
        ``timeout_s`` (default: the page timeout). Intermediate answers (``{"page": i}``) go to
        ``on_step``.

        Raises:
            OcrError: the worker's own error; ``decode_timeout`` when a limit passed (the worker is
                killed); ``image_too_complex`` when the worker died.
            RuntimeError: the worker reported a bug (``internal_error``): the runner's bounded
                retries and DLQ handle it like any other failure.
        """
        cfg = self.cfg
        total = timeout_s if timeout_s is not None else cfg.page_timeout_s
        msg = dict(msg, max_pixels=self.limits.max_pixels, max_pages=self.limits.max_pages)
        w = await self._take()
        healthy = False
        try:
            start = time.monotonic()
            try:
                w.send(msg, fds)
            except OSError:  # it died while idle (killed from outside): once more, on a new one
                self._drop(w, "exited")
                w = None
                self._give_back(None)
                w = await self._take()
                w.send(msg, fds)
            while True:
                left = start + total - time.monotonic()
                try:
                    ans = await w.recv(min(cfg.page_timeout_s, left))
                except asyncio.TimeoutError:
                    which = "one page" if left > cfg.page_timeout_s else "the request"
                    limit = cfg.page_timeout_s if left > cfg.page_timeout_s else total
                    self._drop(w, "timeout")
                    w = None
                    raise OcrError(ErrorCode.DECODE_TIMEOUT,
                                   f"decoding {which} took longer than {limit:g} s; the decoder was stopped") from None
                except _Died as died:
                    self._drop(w, "died")
                    w = None
                    raise OcrError(ErrorCode.IMAGE_TOO_COMPLEX,
                                   f"the decoder process died reading this image ({_signal_name(died.returncode)}; "
                                   f"its memory limit is {cfg.memory_mb} MiB)") from None
                if "error" in ans:
                    healthy = True
                    if ans["error"] == ErrorCode.INTERNAL_ERROR.value:
                        raise RuntimeError(f"decoder: {ans.get('message', '')}")
                    raise OcrError(ErrorCode(ans["error"]), ans.get("message", ""))
                if "page" in ans:  # one more page written: the next has its own page_timeout_s
                    if on_step is not None:
                        on_step(ans)
                    continue
                healthy = True
                return ans
        except asyncio.CancelledError:
            if w is not None and not healthy:
                self._drop(w, "cancelled")  # mid-call: its state is unknown
                w = None
            raise
        finally:
            if w is not None and not healthy:  # failed to send, or any other surprise: state unknown
                self._drop(w, "error")
                w = None
            if w is not None:
                w.jobs += 1
            self._give_back(w)

    async def sniff(self, src: bytes | BinaryIO) -> ImageInfo:
        """The format check of :func:`services.common.images.imaging.sniff`, in a worker, bounded by
        ``decode.page_timeout_s``.

        Args:
            src: The image bytes, or a seekable file holding them (a spooled upload: passed to
                the worker as a descriptor, not read here).

        Raises:
            OcrError: as :func:`~services.common.images.imaging.sniff`, plus ``decode_timeout`` and
                ``image_too_complex``.
        """
        fd = _input_fd(src)
        try:
            ans = await self._call({"op": "sniff"}, [fd])
        finally:
            os.close(fd)
        return ImageInfo(*ans["info"])

    async def plan(self, src: bytes | BinaryIO) -> Plan:
        """The format check plus every page's size from its header (:func:`~services.common.images.imaging.page_sizes`),
        bounded as :meth:`sniff`."""
        fd = _input_fd(src)
        try:
            ans = await self._call({"op": "plan"}, [fd])
        finally:
            os.close(fd)
        return Plan.of(ImageInfo(*ans["info"]), [tuple(s) for s in ans["sizes"]])

    async def decode(self, src: bytes | BinaryIO, plan: Plan, on_release: Callable[[], None] | None = None) -> DecodedPages:
        """Decode every page of ``src`` (as planned by :meth:`plan`) into one shared buffer.

        Bounded by ``decode.page_timeout_s`` per page and ``decode.timeout_s`` for all pages.
        The caller has set ``plan.nbytes`` aside (a :class:`~services.common.images.pixel_budget.PixelBudget`) and passes what gives
        it back as ``on_release``; it is called on failure too.

        Raises:
            OcrError: ``corrupt_image`` (damaged data, or pages that differ from the plan),
                ``decode_timeout``, ``image_too_complex``, the limit errors of :meth:`plan`.
        """
        try:
            out = os.memfd_create("ocrstream-pages", os.MFD_CLOEXEC)
        except BaseException:
            if on_release is not None:
                on_release()
            raise
        fd = None
        ok = False
        try:
            os.ftruncate(out, plan.nbytes)
            fd = _input_fd(src)
            tracer = trace.get_tracer("ocrstream")
            if trace.get_current_span().get_span_context().is_valid:
                with tracer.start_as_current_span("decode", attributes={"ocrstream.pages": len(plan.sizes)}):
                    backgrounds, sizes = await self._decode_call(plan, fd, out)
            else:
                backgrounds, sizes = await self._decode_call(plan, fd, out)
            # private (copy-on-write) and populated at once: one call instead of a fault per 4 KiB
            buf = mmap.mmap(out, plan.nbytes, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0),
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
            ok = True
            return DecodedPages(plan, buf, on_release, backgrounds, sizes)
        finally:
            os.close(out)
            if fd is not None:
                os.close(fd)
            if not ok and on_release is not None:
                on_release()

    async def _decode_call(self, plan: Plan, fd: int, out: int) -> tuple[tuple[str | None, ...], tuple[tuple[int, int], ...]]:
        """Run the decode request; every page's background and ``(width, height)`` as the worker
        reported them."""
        msg = {"op": "decode", "sizes": [list(s) for s in plan.sizes], "offsets": list(plan.offsets)}
        backgrounds: list[str | None] = [None] * len(plan.sizes)
        sizes: list[tuple[int, int]] = list(plan.sizes)

        def on_page(ans: dict) -> None:
            i, bg, size = ans.get("page"), ans.get("background"), ans.get("size")
            if not (isinstance(i, int) and 0 <= i < len(sizes)):
                return
            if bg in BACKGROUNDS:
                backgrounds[i] = bg
            if isinstance(size, list) and sorted(size) == sorted(plan.sizes[i]):
                sizes[i] = (int(size[0]), int(size[1]))

        await self._call(msg, [fd, out], on_step=on_page, timeout_s=self.cfg.timeout_s)
        return tuple(backgrounds), tuple(sizes)

    async def document_plan(self, src: bytes | BinaryIO) -> Plan:
        """:meth:`plan`, with a PDF or TIFF checked against the document limits
        (``limits.max_document_pages``, ``limits.max_document_pixels``) instead of ``max_pages`` and
        the request's pixel total: :func:`services.common.documents.splitting.document_plan`. Nothing is
        rendered; bounded by ``decode.page_timeout_s``.

        Raises:
            OcrError: ``document_too_many_pages``, ``document_too_large``, and what :meth:`plan` raises.
        """
        fd = _input_fd(src)
        try:
            ans = await self._call({"op": "doc_plan", "max_document_pages": self.limits.max_document_pages,
                                    "max_document_pixels": self.limits.max_document_pixels}, [fd])
        finally:
            os.close(fd)
        return Plan.of(ImageInfo(*ans["info"]), [tuple(s) for s in ans["sizes"]])

    async def render_pages(self, src: bytes | BinaryIO, first: int, count: int,
                           after_stop: bool = False) -> list[Rendered]:
        """Pages ``first .. first+count-1`` (0-based) of a PDF or TIFF as PNG bytes
        (:func:`services.common.documents.splitting.render_pages`) in a decoder process, each page within
        ``decode.page_timeout_s``, all within ``decode.timeout_s``, back through a ``memfd``.
        A page that alone cannot be rendered is its ``OcrError`` in the list: the decoder's answer
        (``corrupt_image``, ``image_too_large``, ``image_too_complex``), or a :class:`DecoderStopped`
        when the process was stopped over it or died on it (a fresh one renders the pages after it).

        Args:
            after_stop: The page before ``first`` was a :class:`DecoderStopped` (the rule below spans batches).

        Returns:
            ``[(png, width, height) or OcrError, ...]`` in page order (fewer past the last page).

        Raises:
            OcrError: the document cannot be read as a whole (``corrupt_image``, ``unsupported_format``),
                or the decoder was stopped on two pages in a row (``decode_timeout``, ``image_too_complex``).
        """
        pages: list[Rendered] = []
        while len(pages) < count:
            at = first + len(pages)
            got: list[Rendered] = []
            try:
                await self._render_call(src, at, first + count - at, got)
            except OcrError as err:
                stopped = isinstance(pages[-1], DecoderStopped) if pages else after_stop
                pages.extend(got)
                if err.code not in (ErrorCode.DECODE_TIMEOUT, ErrorCode.IMAGE_TOO_COMPLEX) or (stopped and not got):
                    raise
                pages.append(DecoderStopped(err.code, f"page {first + len(pages) + 1}: {err.message}"))
                continue
            pages.extend(got)
            break  # every page asked for, or the last page passed
        return pages

    async def _render_call(self, src: bytes | BinaryIO, first: int, count: int, got: list[Rendered]) -> None:
        """One ``render`` request; every page it reported is appended to ``got``, also when it raises."""
        out = os.memfd_create("ocrstream-pngs", os.MFD_CLOEXEC)
        fd = None
        spans: list[tuple[int, int, int, int] | OcrError] = []

        def on_page(ans: dict) -> None:
            if "failed" in ans:
                spans.append(OcrError(ErrorCode(ans["failed"]), str(ans.get("message", ""))))
            else:
                spans.append((int(ans["offset"]), int(ans["length"]), *map(int, ans["size"])))

        try:
            fd = _input_fd(src)
            await self._call({"op": "render", "first": first, "count": count}, [fd, out], on_step=on_page,
                             timeout_s=self.cfg.timeout_s)
        finally:
            got.extend(sp if isinstance(sp, OcrError) else (os.pread(out, sp[1], sp[0]), sp[2], sp[3])
                       for sp in spans)
            os.close(out)
            if fd is not None:
                os.close(fd)

    async def decode_all(self, src: bytes | BinaryIO) -> DecodedPages:
        """:meth:`plan` then :meth:`decode`, taking no budget (callers that hold one image at a
        time: the near-duplicate check)."""
        return await self.decode(src, await self.plan(src))
