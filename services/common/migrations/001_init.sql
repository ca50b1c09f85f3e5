-- ocrstream schema v1: one row per request (its final state) and one per cache key (the OCR output).
CREATE TABLE IF NOT EXISTS requests (
  request_id      VARCHAR(64)  NOT NULL PRIMARY KEY,
  status          ENUM('ok','error') NOT NULL,
  error_code      VARCHAR(32)  NULL,
  error_message   VARCHAR(1024) NULL,
  content_sha256  CHAR(64)     NULL,
  cache_key       VARCHAR(96)  NULL,
  cache_hit       TINYINT(1)   NOT NULL DEFAULT 0,
  task            VARCHAR(64)  NOT NULL DEFAULT 'ocr',
  source          VARCHAR(64)  NOT NULL DEFAULT 'default',
  filename        VARCHAR(512) NULL,
  line_count      INT          NOT NULL DEFAULT 0,
  result_uri      VARCHAR(512) NULL,
  trace_id        CHAR(32)     NULL,
  submitted_at_ms BIGINT       NULL,
  completed_at_ms BIGINT       NOT NULL,
  total_ms        DOUBLE       NULL,
  timings_json    JSON         NULL,
  document_json   LONGTEXT     NOT NULL,
  updated_at      TIMESTAMP(3) NOT NULL DEFAULT CURRENT_TIMESTAMP(3) ON UPDATE CURRENT_TIMESTAMP(3),
  KEY idx_requests_sha (content_sha256),
  KEY idx_requests_completed (completed_at_ms)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE IF NOT EXISTS results (
  cache_key       VARCHAR(96)  NOT NULL PRIMARY KEY,
  content_sha256  CHAR(64)     NOT NULL,
  engine          VARCHAR(32)  NOT NULL,
  model           VARCHAR(128) NOT NULL,
  model_revision  VARCHAR(128) NOT NULL,
  task            VARCHAR(64)  NOT NULL,
  result_uri      VARCHAR(512) NOT NULL,
  line_count      INT          NOT NULL,
  text            LONGTEXT     NOT NULL,
  created_at_ms   BIGINT       NOT NULL,
  KEY idx_results_sha (content_sha256),
  KEY idx_results_rev (model_revision)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
