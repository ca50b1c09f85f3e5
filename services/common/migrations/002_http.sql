-- ocrstream schema v2: the HTTP front door's API keys and webhook deliveries.
CREATE TABLE IF NOT EXISTS api_keys (
  key_id          VARCHAR(32)  NOT NULL PRIMARY KEY,
  name            VARCHAR(128) NOT NULL,
  key_hash        CHAR(64)     NOT NULL,
  webhook_secret  VARCHAR(128) NOT NULL,
  rate_per_s      DOUBLE       NULL,
  burst           INT          NULL,
  quota_per_day   INT          NULL,
  created_at_ms   BIGINT       NOT NULL,
  revoked_at_ms   BIGINT       NULL,
  UNIQUE KEY uq_api_keys_hash (key_hash)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE IF NOT EXISTS webhook_deliveries (
  delivery_id     VARCHAR(64)  NOT NULL PRIMARY KEY,
  request_id      VARCHAR(64)  NOT NULL,
  key_id          VARCHAR(32)  NULL,
  url             VARCHAR(2048) NOT NULL,
  body            LONGTEXT     NOT NULL,
  state           ENUM('pending','delivered','failed') NOT NULL DEFAULT 'pending',
  attempts        INT          NOT NULL DEFAULT 0,
  next_attempt_at_ms BIGINT    NOT NULL,
  give_up_at_ms   BIGINT       NOT NULL,
  last_status     INT          NULL,
  last_error      VARCHAR(1024) NULL,
  created_at_ms   BIGINT       NOT NULL,
  delivered_at_ms BIGINT       NULL,
  KEY idx_webhook_due (state, next_attempt_at_ms),
  KEY idx_webhook_request (request_id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE IF NOT EXISTS webhook_attempts (
  delivery_id     VARCHAR(64)  NOT NULL,
  attempt         INT          NOT NULL,
  at_ms           BIGINT       NOT NULL,
  http_status     INT          NULL,
  error           VARCHAR(1024) NULL,
  duration_ms     DOUBLE       NOT NULL,
  PRIMARY KEY (delivery_id, attempt)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
