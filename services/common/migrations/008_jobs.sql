-- ocrstream schema v8: jobs (docs/jobs.md). Written by the jobs stage only (the doors publish
-- ocr.jobs events and read these tables). `jobs`: one row per job, its control state and its one
-- completion event, and `job_requests`: the final state of each request of a job, written once (a
-- replayed completion changes nothing), so a job's counts are exact under at-least-once delivery.
CREATE TABLE IF NOT EXISTS jobs (
  job_id            VARCHAR(64)   NOT NULL PRIMARY KEY,
  name              VARCHAR(256)  NULL,
  task              VARCHAR(64)   NULL,
  task_params_json  TEXT          NULL,
  webhook_url       VARCHAR(2048) NULL,
  api_key_id        VARCHAR(64)   NULL,
  created_at_ms     BIGINT        NULL,           -- the create event's at_ms (NULL: first seen on a completion)
  expected          INT           NULL,           -- the first close event's count (NULL: open)
  closed_at_ms      BIGINT        NULL,
  completed_at_ms   BIGINT        NULL,           -- set with completion_json
  completion_json   MEDIUMTEXT    NULL,           -- the ocr.job_completed.v1 bytes, stored before producing
  completion_sent   TINYINT(1)    NOT NULL DEFAULT 0,  -- 1 once Kafka acknowledged it
  updated_at        TIMESTAMP(3)  NOT NULL DEFAULT CURRENT_TIMESTAMP(3) ON UPDATE CURRENT_TIMESTAMP(3)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE IF NOT EXISTS job_requests (
  job_id           VARCHAR(64)   NOT NULL,
  request_id       VARCHAR(64)   NOT NULL,
  status           VARCHAR(16)   NOT NULL,        -- ok, error (partial: a document with failed pages)
  error_code       VARCHAR(32)   NULL,
  cache_hit        TINYINT(1)    NOT NULL DEFAULT 0,
  pages            INT           NOT NULL DEFAULT 1,
  line_count       INT           NOT NULL DEFAULT 0,
  char_count       INT           NOT NULL DEFAULT 0,
  mean_confidence  DOUBLE        NULL,
  filename         VARCHAR(512)  NULL,
  total_ms         DOUBLE        NULL,
  inference_ms     DOUBLE        NULL,
  timings_json     JSON          NULL,
  fields_json      JSON          NULL,
  submitted_at_ms  BIGINT        NULL,
  completed_at_ms  BIGINT        NOT NULL,
  seq              BIGINT        NOT NULL AUTO_INCREMENT UNIQUE,  -- insertion order: the report's row order
  PRIMARY KEY (job_id, request_id),
  KEY idx_job_requests_order (job_id, seq)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
