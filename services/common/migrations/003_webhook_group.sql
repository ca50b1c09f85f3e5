-- ocrstream schema v3: webhook deliveries belong to the dispatcher group (consumer group) that
-- accepted them, so deployments or test namespaces sharing one database never send each
-- other's callbacks. The due-row index leads with the group. (No semicolons in comments:
-- the migration runner splits statements on them.)
ALTER TABLE webhook_deliveries
  ADD COLUMN IF NOT EXISTS group_id VARCHAR(128) NOT NULL DEFAULT '' AFTER delivery_id,
  ADD KEY IF NOT EXISTS idx_webhook_group_due (group_id, state, next_attempt_at_ms);
