DROP TABLE IF EXISTS "outbox_cursor";

DROP INDEX IF EXISTS "outbox_logged_idx";

ALTER TABLE "outbox" DROP CONSTRAINT IF EXISTS "outbox_status_check", ADD CONSTRAINT "outbox_status_check" CHECK (status IN ('pending', 'sent', 'dead'));

ALTER TABLE "outbox" DROP COLUMN IF EXISTS xid;

DELETE FROM "outbox_migrations" WHERE version = 4;
