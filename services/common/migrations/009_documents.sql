-- ocrstream schema v9: documents (a PDF or multi-page TIFF split into one request per page at
-- ingest, docs/documents.md). Ingest inserts the `documents` row before it announces the pages
-- (INSERT IGNORE: a replay of the split keeps the first), the sink upserts one `document_pages`
-- row per page as the page's final state is written (the first kept), in one transaction that
-- locks the document's row, so the page that completes the document is known exactly
-- (`completed_by`) whatever the replays, sink processes and SIGKILLs.
CREATE TABLE IF NOT EXISTS documents (
  document_id     VARCHAR(64)  NOT NULL PRIMARY KEY,  -- the document's request id
  content_sha256  CHAR(64)     NOT NULL,              -- the PDF's or TIFF's own bytes
  page_count      INT          NOT NULL,
  request_json    MEDIUMTEXT   NOT NULL,              -- the document's ocr.request.v1 (filename, task, callback ...)
  created_at_ms   BIGINT       NOT NULL,
  completed_by    INT          NULL,                  -- the page whose final state made every page final
  status          ENUM('ok','error','partial') NULL,  -- set once the document result is assembled
  result_uri      VARCHAR(1024) NULL                  -- s3://.../documents/<document_id>.json
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE IF NOT EXISTS document_pages (
  document_id     VARCHAR(64)  NOT NULL,
  page_number     INT          NOT NULL,              -- 1-based
  request_id      VARCHAR(64)  NOT NULL,              -- the page's own request (requests.request_id)
  status          ENUM('ok','error') NOT NULL,
  error_code      VARCHAR(64)  NULL,
  content_sha256  CHAR(64)     NULL,
  completed_at_ms BIGINT       NULL,
  PRIMARY KEY (document_id, page_number)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

-- a document's own final state may be partial
ALTER TABLE requests MODIFY status ENUM('ok','error','partial') NOT NULL;
