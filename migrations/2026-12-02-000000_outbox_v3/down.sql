ALTER TABLE "outbox" SET (fillfactor = 70);

DELETE FROM "outbox_migrations" WHERE version = 3;
