ALTER TABLE "outbox_relays" DROP COLUMN IF EXISTS blocked_since;

DELETE FROM "outbox_migrations" WHERE version = 2;
