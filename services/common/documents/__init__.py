"""Documents (PDFs, multi-page TIFFs) as pages: split, registered, assembled (``docs/documents.md``).

- :mod:`.splitting`: the page count and pixel checks before any render, then one page at a time.
- :mod:`.pdf_tree`: a PDF opened with every page its page tree holds, whatever its ``/Count`` says.
- :mod:`.state`: a document's row and its pages' final states in MariaDB.

Ingest splits (``services/ingest/split.py``); the sink assembles (``services/sink/documents.py``) and
caches the assembled document (``services/sink/document_cache.py``).
"""
