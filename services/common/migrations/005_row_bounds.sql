-- ocrstream schema v5: rows are bounded by design (OCRSTREAM_MYSQL__ROW_MAX_BYTES, 1 MiB by
-- default). The whole OCR output lives in S3 at result_uri. A result whose text is over the bound
-- keeps its first part in results.text, with text_truncated = 1. A request whose document is over
-- it keeps its summary in document_json, its lines left out or its text cut, with
-- document_truncated = 1 (and lines_omitted, text_truncated inside the JSON).
ALTER TABLE results
  ADD COLUMN IF NOT EXISTS text_truncated TINYINT(1) NOT NULL DEFAULT 0 AFTER text;
ALTER TABLE requests
  ADD COLUMN IF NOT EXISTS document_truncated TINYINT(1) NOT NULL DEFAULT 0 AFTER document_json
