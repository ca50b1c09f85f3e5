"""Hostile inputs generated for the tests (never committed as files): each is small and costs a
naive decoder unbounded time, memory or CPU."""

from __future__ import annotations

import io
import struct


def nested_xobject_pdf(depth: int = 7, fanout: int = 10) -> bytes:
    """A one-page PDF whose content draws form XObject 0, which draws form 1 ``fanout`` times,
    which draws form 2 ``fanout`` times, ... ``depth`` levels: ``fanout ** depth`` draws of a
    tiny rectangle (10^7 with the defaults) from about 2 KB of file."""
    objs: list[bytes] = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /XObject << /X 5 0 R >> >>"
        b" /Contents 4 0 R >>",
    ]

    def stream(dict_body: bytes, content: bytes) -> bytes:
        return b"<< " + dict_body + b" /Length %d >>\nstream\n" % len(content) + content + b"\nendstream"

    objs.append(stream(b"", b"/X Do"))
    for level in range(depth + 1):
        num = 5 + level
        if level < depth:
            content = b" ".join([b"/X Do"] * fanout)
            res = b"/Resources << /XObject << /X %d 0 R >> >>" % (num + 1)
        else:
            content, res = b"0 0 0 rg 10 10 2 2 re f", b""
        objs.append(stream(b"/Type /XObject /Subtype /Form /BBox [0 0 612 792] " + res, content))
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objs, start=1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % i + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1))
    for off in offsets:
        out.write(b"%010d 00000 n \n" % off)
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref))
    return out.getvalue()


def chained_header_tiff(pages: int = 100_000) -> bytes:
    """A little-endian TIFF of ``pages`` 1x1 pages whose image file directories follow one another
    (each IFD's next pointer names the next): counting its frames with Pillow's ``n_frames``
    costs time quadratic in ``pages`` (about 94 s for 100,000)."""
    tags = 8  # ImageWidth, ImageLength, BitsPerSample, Compression, Photometric, StripOffsets, RowsPerStrip, StripByteCounts
    ifd_size = 2 + tags * 12 + 4
    pixel_at = 8
    first = 8 + 2  # 1 pixel byte (+ pad) after the header
    out = bytearray(b"II*\x00" + struct.pack("<I", first) + b"\xff\x00")
    for i in range(pages):
        here = first + i * ifd_size
        nxt = here + ifd_size if i + 1 < pages else 0
        entries = [(256, 3, 1, 1), (257, 3, 1, 1), (258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1),
                   (273, 4, 1, pixel_at), (278, 3, 1, 1), (279, 4, 1, 1)]
        out += struct.pack("<H", tags)
        for tag, typ, count, value in entries:
            out += struct.pack("<HHII", tag, typ, count, value)
        out += struct.pack("<I", nxt)
    return bytes(out)


def eps_file() -> bytes:
    """A minimal Encapsulated PostScript file (Pillow's EPS plugin would hand it to Ghostscript)."""
    body = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 100 100\n0 0 moveto 100 100 lineto stroke\nshowpage\n%%EOF\n"
    return body


def miscounted_pdf(pdf: bytes, count: int) -> bytes:
    """``pdf`` (one page tree node, as Pillow writes it) with its ``/Count`` replaced by ``count``,
    the byte offsets unchanged (``count`` has as many digits as the true count): the page tree
    holds the same pages, its ``/Count`` says otherwise."""
    import re

    [old] = re.findall(rb"/Count (\d+)", pdf)
    new = str(count).encode()
    assert len(new) == len(old), "keep the digits: the xref's offsets must stay true"
    return pdf.replace(b"/Count " + old, b"/Count " + new, 1)
