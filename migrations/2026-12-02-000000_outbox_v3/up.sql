ALTER TABLE "outbox" SET (fillfactor = 50);

INSERT INTO "outbox_migrations" (version) VALUES (3) ON CONFLICT DO NOTHING;
