ALTER TABLE "outbox_cursor" DROP COLUMN IF EXISTS walk_from;

DELETE FROM "outbox_migrations" WHERE version = 5;
