ALTER TABLE "outbox_cursor" ADD COLUMN IF NOT EXISTS walk_from bigint NOT NULL DEFAULT 0;

INSERT INTO "outbox_migrations" (version) VALUES (5) ON CONFLICT DO NOTHING;
