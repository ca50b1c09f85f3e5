-- ocrstream schema v6: who took each client-chosen request id, written when a door accepts it
-- (services/common/requests/claims.py). One row per id, never overwritten: a later submission with the
-- same id is compared with it (same image, task and API key: a retry, else request_id_conflict).
CREATE TABLE IF NOT EXISTS request_claims (
  request_id      VARCHAR(64)  NOT NULL PRIMARY KEY,
  content_sha256  CHAR(64)     NULL,          -- NULL: the submission ended before its image was read
  task            VARCHAR(64)  NULL,
  api_key_id      VARCHAR(32)  NULL,          -- the HTTP door API key, NULL: the Kafka door or keys off
  door            VARCHAR(16)  NOT NULL,      -- kafka | http | migrated
  origin          VARCHAR(320) NULL,          -- the Kafka door: topic/partition/offset of the submission
  token           CHAR(32)     NOT NULL,      -- the claimer own mark: only it may release the claim
  claimed_at_ms   BIGINT       NOT NULL
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

-- Requests that finished before claims existed keep their ids: one claim each, from their row.
INSERT INTO request_claims (request_id, content_sha256, task, api_key_id, door, origin, token, claimed_at_ms)
SELECT request_id, content_sha256, task,
       NULLIF(JSON_UNQUOTE(JSON_EXTRACT(document_json, '$.api_key_id')), 'null'),
       'migrated', NULL, REPEAT('0', 32), completed_at_ms
FROM requests
ON DUPLICATE KEY UPDATE request_id = request_claims.request_id;
