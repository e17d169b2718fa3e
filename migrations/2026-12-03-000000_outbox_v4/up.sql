ALTER TABLE "outbox" ADD COLUMN IF NOT EXISTS xid xid8;

ALTER TABLE "outbox" ALTER COLUMN xid SET DEFAULT pg_current_xact_id();

ALTER TABLE "outbox" DROP CONSTRAINT IF EXISTS "outbox_status_check", ADD CONSTRAINT "outbox_status_check" CHECK (status IN ('pending', 'sent', 'dead', 'logged')) NOT VALID;

ALTER TABLE "outbox" VALIDATE CONSTRAINT "outbox_status_check";

CREATE INDEX IF NOT EXISTS "outbox_logged_idx" ON "outbox" (xid, id) WHERE status = 'logged';

CREATE TABLE IF NOT EXISTS "outbox_cursor" (
    part integer NOT NULL,
    lo pg_snapshot NOT NULL,
    hi pg_snapshot NOT NULL,
    ceiling bigint NOT NULL DEFAULT 0,
    after bigint NOT NULL DEFAULT 0,
    tick bigint NOT NULL DEFAULT 0,
    page_attempts integer NOT NULL DEFAULT 0,
    owner text,
    lease_until timestamptz,
    token bigint NOT NULL DEFAULT 0,
    CONSTRAINT "outbox_cursor_pkey" PRIMARY KEY (part)
);

INSERT INTO "outbox_migrations" (version) VALUES (4) ON CONFLICT DO NOTHING;
