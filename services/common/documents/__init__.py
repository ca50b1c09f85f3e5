"""Documents (PDFs, multi-page TIFFs) as pages: split, registered, assembled (``docs/documents.md``).

- :mod:`.splitting`: the page count and pixel checks before any render, then one page at a time.
- :mod:`.pdf_tree`: a PDF opened with every page its page tree holds, whatever its ``/Count`` says.
- :mod:`.split`: ingest's split of a document into one request per page.
- :mod:`.state`: a document's row and its pages' final states in MariaDB.
- :mod:`.assembly`: the sink's assembly of a document once every page is final.

The sink's cache of an assembled document (``services/sink/document_cache.py``) reads the sink's
settings and stays in the sink.
"""
