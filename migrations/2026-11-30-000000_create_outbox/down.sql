DROP TABLE IF EXISTS "outbox_relays";

DROP TABLE IF EXISTS "outbox_inbox";

DROP TABLE IF EXISTS "outbox";

DELETE FROM "outbox_migrations" WHERE version = 1;

DROP TABLE IF EXISTS "outbox_migrations";
