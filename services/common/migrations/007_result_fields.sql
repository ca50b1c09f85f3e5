-- ocrstream schema v7: the fields of every `extract` result, one row per field asked, so a SQL
-- user can query them (docs/tasks.md). Written by the sink with the result's `results` row, in
-- one transaction that first deletes the key's rows (a replay or a recompute writes the same
-- rows again). The fields of a key are a set (the same fields in another order are one cache key):
-- `position` is their order in the answer of the request that computed it.
CREATE TABLE IF NOT EXISTS result_fields (
  cache_key       VARCHAR(96)  NOT NULL,          -- results.cache_key
  position        SMALLINT     NOT NULL,          -- 0-based place in the answer (at most 50 fields)
  content_sha256  CHAR(64)     NOT NULL,
  field_name      VARCHAR(100) NOT NULL,          -- as asked, trimmed (schemas/tasks.py: 1-100 characters)
  value           MEDIUMTEXT   NULL,              -- NULL: the field is not on the image
  created_at_ms   BIGINT       NOT NULL,
  PRIMARY KEY (cache_key, position),
  KEY idx_result_fields_sha (content_sha256),
  KEY idx_result_fields_name (field_name)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
