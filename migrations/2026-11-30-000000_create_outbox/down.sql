DROP TABLE IF EXISTS "outbox_relays";

DROP TABLE IF EXISTS "outbox_inbox";

DROP TABLE IF EXISTS "outbox";

DROP TABLE IF EXISTS "outbox_migrations";
