-- ocrstream schema v4: finished webhook deliveries are deleted after a retention period
-- (OCRSTREAM_WEBHOOK_RETENTION_DAYS). This index finds a group's old rows without a scan.
ALTER TABLE webhook_deliveries
  ADD KEY IF NOT EXISTS idx_webhook_group_created (group_id, created_at_ms);
