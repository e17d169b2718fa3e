CREATE TABLE IF NOT EXISTS "outbox_migrations" (
    version integer NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT "outbox_migrations_pkey" PRIMARY KEY (version)
);

CREATE TABLE IF NOT EXISTS "outbox" (
    id bigint GENERATED ALWAYS AS IDENTITY (SEQUENCE NAME "outbox_id_seq"),
    idempotency_key text NOT NULL,
    topic text NOT NULL,
    aggregate_key text,
    payload bytea NOT NULL,
    content_type text,
    headers jsonb NOT NULL DEFAULT '{}'::jsonb,
    status text NOT NULL DEFAULT 'pending',
    attempts integer NOT NULL DEFAULT 0,
    fencing_token bigint NOT NULL DEFAULT 0,
    available_at timestamptz NOT NULL DEFAULT now(),
    lease_until timestamptz,
    last_error text,
    created_at timestamptz NOT NULL DEFAULT now(),
    sent_at timestamptz,
    dead_at timestamptz,
    CONSTRAINT "outbox_pkey" PRIMARY KEY (id),
    CONSTRAINT "outbox_key_unique" UNIQUE (idempotency_key),
    CONSTRAINT "outbox_status_check" CHECK (status IN ('pending', 'sent', 'dead'))
) WITH (fillfactor = 70);

CREATE INDEX IF NOT EXISTS "outbox_pending_idx" ON "outbox" (id) WHERE status = 'pending';

CREATE INDEX IF NOT EXISTS "outbox_aggregate_idx" ON "outbox" (aggregate_key, id) WHERE status = 'pending' AND aggregate_key IS NOT NULL;

CREATE INDEX IF NOT EXISTS "outbox_sent_idx" ON "outbox" (sent_at) WHERE status = 'sent';

CREATE INDEX IF NOT EXISTS "outbox_dead_idx" ON "outbox" (id) WHERE status = 'dead';

CREATE TABLE IF NOT EXISTS "outbox_inbox" (
    consumer text NOT NULL,
    idempotency_key text NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT "outbox_inbox_pkey" PRIMARY KEY (consumer, idempotency_key)
);

CREATE INDEX IF NOT EXISTS "outbox_inbox_processed_idx" ON "outbox_inbox" (processed_at);

CREATE UNLOGGED TABLE IF NOT EXISTS "outbox_relays" (
    relay_id text NOT NULL,
    idle boolean NOT NULL,
    expires_at timestamptz NOT NULL,
    CONSTRAINT "outbox_relays_pkey" PRIMARY KEY (relay_id)
);

INSERT INTO "outbox_migrations" (version) VALUES (1) ON CONFLICT DO NOTHING;
