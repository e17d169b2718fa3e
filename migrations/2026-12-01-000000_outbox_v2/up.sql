ALTER TABLE "outbox_relays" ADD COLUMN IF NOT EXISTS blocked_since timestamptz;

INSERT INTO "outbox_migrations" (version) VALUES (2) ON CONFLICT DO NOTHING;
