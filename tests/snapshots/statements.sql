-- create_schema
CREATE SCHEMA IF NOT EXISTS "sales";

-- create_migrations
CREATE TABLE IF NOT EXISTS "sales"."orders_outbox_migrations" (
    version integer NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT "orders_outbox_migrations_pkey" PRIMARY KEY (version)
);

-- select_versions
SELECT version FROM "sales"."orders_outbox_migrations" ORDER BY version;

-- record_version
-- params: integer
INSERT INTO "sales"."orders_outbox_migrations" (version) VALUES ($1) ON CONFLICT DO NOTHING;

-- missing_tables
SELECT t.name, t.since FROM (VALUES ('sales.orders_outbox', 1, '"sales"."orders_outbox"'), ('sales.orders_outbox_inbox', 1, '"sales"."orders_outbox_inbox"'), ('sales.orders_outbox_relays', 1, '"sales"."orders_outbox_relays"'), ('sales.orders_outbox_cursor', 4, '"sales"."orders_outbox_cursor"')) AS t (name, since, quoted) WHERE t.since <= (SELECT max(version) FROM "sales"."orders_outbox_migrations") AND to_regclass(t.quoted) IS NULL ORDER BY t.since, t.name;

-- migration 1 up 0
CREATE TABLE IF NOT EXISTS "sales"."orders_outbox" (
    id bigint GENERATED ALWAYS AS IDENTITY (SEQUENCE NAME "sales"."orders_outbox_id_seq"),
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
    CONSTRAINT "orders_outbox_pkey" PRIMARY KEY (id),
    CONSTRAINT "orders_outbox_key_unique" UNIQUE (idempotency_key),
    CONSTRAINT "orders_outbox_status_check" CHECK (status IN ('pending', 'sent', 'dead'))
) WITH (fillfactor = 70);

-- migration 1 up 1
CREATE INDEX IF NOT EXISTS "orders_outbox_pending_idx" ON "sales"."orders_outbox" (id) WHERE status = 'pending';

-- migration 1 up 2
CREATE INDEX IF NOT EXISTS "orders_outbox_aggregate_idx" ON "sales"."orders_outbox" (aggregate_key, id) WHERE status = 'pending' AND aggregate_key IS NOT NULL;

-- migration 1 up 3
CREATE INDEX IF NOT EXISTS "orders_outbox_sent_idx" ON "sales"."orders_outbox" (sent_at) WHERE status = 'sent';

-- migration 1 up 4
CREATE INDEX IF NOT EXISTS "orders_outbox_dead_idx" ON "sales"."orders_outbox" (id) WHERE status = 'dead';

-- migration 1 up 5
CREATE TABLE IF NOT EXISTS "sales"."orders_outbox_inbox" (
    consumer text NOT NULL,
    idempotency_key text NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT "orders_outbox_inbox_pkey" PRIMARY KEY (consumer, idempotency_key)
);

-- migration 1 up 6
CREATE INDEX IF NOT EXISTS "orders_outbox_inbox_processed_idx" ON "sales"."orders_outbox_inbox" (processed_at);

-- migration 1 up 7
CREATE UNLOGGED TABLE IF NOT EXISTS "sales"."orders_outbox_relays" (
    relay_id text NOT NULL,
    idle boolean NOT NULL,
    expires_at timestamptz NOT NULL,
    CONSTRAINT "orders_outbox_relays_pkey" PRIMARY KEY (relay_id)
);

-- migration 1 down 0
DROP TABLE IF EXISTS "sales"."orders_outbox_relays";

-- migration 1 down 1
DROP TABLE IF EXISTS "sales"."orders_outbox_inbox";

-- migration 1 down 2
DROP TABLE IF EXISTS "sales"."orders_outbox";

-- migration 1 down 3
DELETE FROM "sales"."orders_outbox_migrations" WHERE version = 1;

-- migration 2 up 0
ALTER TABLE "sales"."orders_outbox_relays" ADD COLUMN IF NOT EXISTS blocked_since timestamptz;

-- migration 2 down 0
ALTER TABLE "sales"."orders_outbox_relays" DROP COLUMN IF EXISTS blocked_since;

-- migration 2 down 1
DELETE FROM "sales"."orders_outbox_migrations" WHERE version = 2;

-- migration 3 up 0
ALTER TABLE "sales"."orders_outbox" SET (fillfactor = 50);

-- migration 3 down 0
ALTER TABLE "sales"."orders_outbox" SET (fillfactor = 70);

-- migration 3 down 1
DELETE FROM "sales"."orders_outbox_migrations" WHERE version = 3;

-- migration 4 up 0
ALTER TABLE "sales"."orders_outbox" ADD COLUMN IF NOT EXISTS xid xid8;

-- migration 4 up 1
ALTER TABLE "sales"."orders_outbox" ALTER COLUMN xid SET DEFAULT pg_current_xact_id();

-- migration 4 up 2
ALTER TABLE "sales"."orders_outbox" DROP CONSTRAINT IF EXISTS "orders_outbox_status_check", ADD CONSTRAINT "orders_outbox_status_check" CHECK (status IN ('pending', 'sent', 'dead', 'logged')) NOT VALID;

-- migration 4 up 3
ALTER TABLE "sales"."orders_outbox" VALIDATE CONSTRAINT "orders_outbox_status_check";

-- migration 4 up 4
CREATE INDEX IF NOT EXISTS "orders_outbox_logged_idx" ON "sales"."orders_outbox" (xid, id) WHERE status = 'logged';

-- migration 4 up 5
CREATE TABLE IF NOT EXISTS "sales"."orders_outbox_cursor" (
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
    CONSTRAINT "orders_outbox_cursor_pkey" PRIMARY KEY (part)
);

-- migration 4 down 0
DROP TABLE IF EXISTS "sales"."orders_outbox_cursor";

-- migration 4 down 1
DROP INDEX IF EXISTS "sales"."orders_outbox_logged_idx";

-- migration 4 down 2
ALTER TABLE "sales"."orders_outbox" DROP CONSTRAINT IF EXISTS "orders_outbox_status_check", ADD CONSTRAINT "orders_outbox_status_check" CHECK (status IN ('pending', 'sent', 'dead'));

-- migration 4 down 3
ALTER TABLE "sales"."orders_outbox" DROP COLUMN IF EXISTS xid;

-- migration 4 down 4
DELETE FROM "sales"."orders_outbox_migrations" WHERE version = 4;

-- migration 5 up 0
ALTER TABLE "sales"."orders_outbox_cursor" ADD COLUMN IF NOT EXISTS walk_from bigint NOT NULL DEFAULT 0;

-- migration 5 down 0
ALTER TABLE "sales"."orders_outbox_cursor" DROP COLUMN IF EXISTS walk_from;

-- migration 5 down 1
DELETE FROM "sales"."orders_outbox_migrations" WHERE version = 5;

-- engine is_log
SELECT EXISTS (SELECT 1 FROM "sales"."orders_outbox_cursor") AS log;

-- engine to_log
SET LOCAL lock_timeout = '10s';
LOCK TABLE "sales"."orders_outbox" IN ACCESS EXCLUSIVE MODE;
UPDATE "sales"."orders_outbox" SET status = 'sent', sent_at = now() WHERE status = 'logged';
ALTER TABLE "sales"."orders_outbox" DROP CONSTRAINT IF EXISTS "orders_outbox_status_check", ADD CONSTRAINT "orders_outbox_status_check" CHECK (status IN ('pending', 'sent', 'dead', 'logged')) NOT VALID;
ALTER TABLE "sales"."orders_outbox" ALTER COLUMN status SET DEFAULT 'logged';
INSERT INTO "sales"."orders_outbox_cursor" (part, lo, hi)
    SELECT 0, s, s FROM (SELECT (x || ':' || x || ':')::pg_snapshot AS s FROM (SELECT least(pg_snapshot_xmin(pg_current_snapshot()), pg_current_xact_id()) AS x) AS a) AS b
ON CONFLICT (part) DO NOTHING;

-- engine to_per_row
SET LOCAL lock_timeout = '10s';
LOCK TABLE "sales"."orders_outbox" IN ACCESS EXCLUSIVE MODE;
WITH c AS MATERIALIZED (SELECT lo, hi, after FROM "sales"."orders_outbox_cursor" WHERE part = 0),
backlog AS MATERIALIZED (
    SELECT o.id, o.xid FROM "sales"."orders_outbox" o WHERE o.status = 'logged' AND o.xid = ANY(ARRAY(SELECT pg_snapshot_xip(lo) FROM c))
    UNION ALL
    SELECT o.id, o.xid FROM "sales"."orders_outbox" o WHERE o.status = 'logged' AND o.xid >= (SELECT pg_snapshot_xmax(lo) FROM c)
)
UPDATE "sales"."orders_outbox" t SET status = 'pending', available_at = now() FROM backlog b, c
    WHERE t.id = b.id AND NOT (pg_visible_in_snapshot(b.xid, c.lo) OR (pg_visible_in_snapshot(b.xid, c.hi) AND b.id <= c.after));
ALTER TABLE "sales"."orders_outbox" ALTER COLUMN status SET DEFAULT 'pending';
ALTER TABLE "sales"."orders_outbox" DROP CONSTRAINT IF EXISTS "orders_outbox_status_check", ADD CONSTRAINT "orders_outbox_status_check" CHECK (status IN ('pending', 'sent', 'dead')) NOT VALID;
DELETE FROM "sales"."orders_outbox_cursor";

-- engine settle_passed
WITH passed AS MATERIALIZED (
    SELECT id FROM "sales"."orders_outbox" WHERE status = 'logged' ORDER BY xid, id LIMIT 10000 FOR UPDATE SKIP LOCKED
)
UPDATE "sales"."orders_outbox" t SET status = 'sent', sent_at = now() FROM passed WHERE t.id = passed.id AND t.status = 'logged' AND NOT EXISTS (SELECT 1 FROM "sales"."orders_outbox_cursor");

-- engine check_unvalidated
SELECT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = '"sales"."orders_outbox"'::regclass AND conname = 'orders_outbox_status_check' AND NOT convalidated) AS unvalidated;

-- engine validate_check
ALTER TABLE "sales"."orders_outbox" VALIDATE CONSTRAINT "orders_outbox_status_check";

-- enqueue
-- params: text[], text[], text[], bytea[], text[], jsonb[], bigint[]
WITH m AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::jsonb[], $7::bigint[]) AS m(k, topic, agg, payload, ct, headers, delay_us)
), dup AS (
    SELECT idempotency_key AS k FROM "sales"."orders_outbox" WHERE idempotency_key = ANY($1::text[])
), ins AS (
    INSERT INTO "sales"."orders_outbox" (idempotency_key, topic, aggregate_key, payload, content_type, headers, available_at)
    SELECT k, topic, agg, payload, ct, headers, now() + delay_us * interval '1 microsecond'
    FROM m WHERE NOT EXISTS (SELECT 1 FROM dup)
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING idempotency_key AS k
)
SELECT k AS key, true AS inserted FROM ins UNION ALL SELECT k AS key, false AS inserted FROM dup;

-- enqueue_notify
-- params: text[], text[], text[], bytea[], text[], jsonb[], bigint[], text
WITH m AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::jsonb[], $7::bigint[]) AS m(k, topic, agg, payload, ct, headers, delay_us)
), dup AS (
    SELECT idempotency_key AS k FROM "sales"."orders_outbox" WHERE idempotency_key = ANY($1::text[])
), ins AS (
    INSERT INTO "sales"."orders_outbox" (idempotency_key, topic, aggregate_key, payload, content_type, headers, available_at)
    SELECT k, topic, agg, payload, ct, headers, now() + delay_us * interval '1 microsecond'
    FROM m WHERE NOT EXISTS (SELECT 1 FROM dup)
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING idempotency_key AS k
), wake AS (
    SELECT pg_notify($8, '') FROM (SELECT 1 FROM ins LIMIT 1) AS any_ins
    WHERE NOT pg_try_advisory_xact_lock_shared(1869968503, '"sales"."orders_outbox"'::regclass::oid::int4)
)
SELECT r.key, r.inserted FROM (SELECT k AS key, true AS inserted FROM ins UNION ALL SELECT k AS key, false AS inserted FROM dup) AS r CROSS JOIN (SELECT count(*) FROM wake) AS w;

-- enqueue_one
-- params: text, text, text, bytea, text, jsonb, bigint
WITH ins AS (
    INSERT INTO "sales"."orders_outbox" (idempotency_key, topic, aggregate_key, payload, content_type, headers, available_at)
    VALUES ($1, $2, $3, $4, $5, $6, now() + $7 * interval '1 microsecond')
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING idempotency_key AS k
)
SELECT k AS key, true AS inserted FROM ins;

-- enqueue_one_notify
-- params: text, text, text, bytea, text, jsonb, bigint, text
WITH ins AS (
    INSERT INTO "sales"."orders_outbox" (idempotency_key, topic, aggregate_key, payload, content_type, headers, available_at)
    VALUES ($1, $2, $3, $4, $5, $6, now() + $7 * interval '1 microsecond')
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING idempotency_key AS k
), wake AS (
    SELECT pg_notify($8, '') FROM ins
    WHERE NOT pg_try_advisory_xact_lock_shared(1869968503, '"sales"."orders_outbox"'::regclass::oid::int4)
)
SELECT k AS key, true AS inserted FROM ins CROSS JOIN (SELECT count(*) FROM wake) AS w;

-- dedupe
-- params: text, text
INSERT INTO "sales"."orders_outbox_inbox" (consumer, idempotency_key) VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING true AS inserted;

-- stats
-- params: text, text
-- under: SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off
WITH c AS MATERIALIZED (SELECT lo, hi, after, ceiling, walk_from FROM "sales"."orders_outbox_cursor" WHERE part = 0),
backlog AS MATERIALIZED (
    SELECT o.created_at FROM "sales"."orders_outbox" o WHERE o.status = 'logged' AND o.xid = ANY(ARRAY(SELECT pg_snapshot_xip(hi) FROM c))
    UNION ALL
    SELECT o.created_at FROM "sales"."orders_outbox" o WHERE o.status = 'logged' AND o.xid >= (SELECT pg_snapshot_xmax(hi) FROM c)
    UNION ALL
    SELECT o.created_at FROM "sales"."orders_outbox" o WHERE o.status = 'logged' AND o.xid = ANY(ARRAY(SELECT x FROM c, pg_snapshot_xip(c.lo) AS x WHERE pg_visible_in_snapshot(x, c.hi))) AND o.id > (SELECT after FROM c) AND o.id <= (SELECT walk_from FROM c)
    UNION ALL
    SELECT o.created_at FROM "sales"."orders_outbox" o WHERE o.id > (SELECT greatest(after, walk_from) FROM c) AND o.id <= (SELECT ceiling FROM c) AND (o.status || '') = 'logged' AND pg_visible_in_snapshot(o.xid, (SELECT hi FROM c)) AND NOT pg_visible_in_snapshot(o.xid, (SELECT lo FROM c))
)
SELECT
    (SELECT count(*) FROM "sales"."orders_outbox" WHERE status = 'pending' AND (lease_until IS NULL OR lease_until <= now())) + (SELECT count(*) FROM backlog) AS pending,
    (SELECT count(*) FROM "sales"."orders_outbox" WHERE status = 'pending' AND lease_until > now()) AS in_flight,
    (SELECT count(*) FROM (SELECT 1 FROM "sales"."orders_outbox" WHERE status = 'sent' LIMIT 100000) AS s) AS sent_counted,
    (SELECT greatest(reltuples, 0)::bigint FROM pg_class WHERE oid = to_regclass($1)) AS sent_estimate,
    (SELECT count(*) FROM (SELECT 1 FROM "sales"."orders_outbox" o WHERE o.status = 'logged' AND o.xid < (SELECT pg_snapshot_xmax(hi) FROM "sales"."orders_outbox_cursor" WHERE part = 0) AND (pg_visible_in_snapshot(o.xid, (SELECT lo FROM "sales"."orders_outbox_cursor" WHERE part = 0)) OR (pg_visible_in_snapshot(o.xid, (SELECT hi FROM "sales"."orders_outbox_cursor" WHERE part = 0)) AND o.id <= (SELECT after FROM "sales"."orders_outbox_cursor" WHERE part = 0))) LIMIT 100000) AS l) AS logged_counted,
    (SELECT greatest(reltuples, 0)::bigint FROM pg_class WHERE oid = to_regclass($2)) - (SELECT count(*) FROM backlog) AS logged_estimate,
    (SELECT count(*) FROM "sales"."orders_outbox" WHERE status = 'dead') AS dead,
    (SELECT (extract(epoch FROM now() - least(min(created_at), (SELECT min(created_at) FROM backlog))) * 1000000)::bigint FROM "sales"."orders_outbox" WHERE status = 'pending' AND available_at <= now()) AS lag_us,
    (SELECT (extract(epoch FROM now() - min(blocked_since)) * 1000000)::bigint FROM "sales"."orders_outbox_relays" WHERE expires_at > now()) AS blocked_us;

-- redrive
-- params: text[]
-- under: SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off
UPDATE "sales"."orders_outbox" SET status = 'pending', attempts = 0, available_at = now(), lease_until = NULL, dead_at = NULL WHERE status = 'dead' AND (cardinality($1::text[]) = 0 OR idempotency_key = ANY($1)) RETURNING idempotency_key AS key;

-- dead_letters
-- params: text, boolean, bigint
-- under: SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off
SELECT id, idempotency_key AS key, topic, aggregate_key, attempts, last_error, created_at, dead_at, CASE WHEN $2 THEN payload END AS payload FROM "sales"."orders_outbox" WHERE status = 'dead' AND ($1::text IS NULL OR topic = $1) ORDER BY id LIMIT $3;

-- discard
-- params: text[]
-- under: SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off
DELETE FROM "sales"."orders_outbox" WHERE status = 'dead' AND idempotency_key = ANY($1::text[]) RETURNING idempotency_key AS key;

-- discard_all
-- params: bigint
-- under: SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off
DELETE FROM "sales"."orders_outbox" WHERE id IN (SELECT id FROM "sales"."orders_outbox" WHERE status = 'dead' ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED) RETURNING idempotency_key AS key;

-- purge_sent
-- params: bigint, bigint
-- under: SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off
WITH sent AS MATERIALIZED (
    SELECT id FROM "sales"."orders_outbox" WHERE status = 'sent' AND sent_at < now() - $1 * interval '1 microsecond'
    ORDER BY sent_at LIMIT $2 FOR UPDATE SKIP LOCKED
), logged AS MATERIALIZED (
    SELECT l.id FROM (SELECT o.id, o.created_at FROM "sales"."orders_outbox" o WHERE o.status = 'logged' AND o.xid < (SELECT pg_snapshot_xmax(hi) FROM "sales"."orders_outbox_cursor" WHERE part = 0) AND (pg_visible_in_snapshot(o.xid, (SELECT lo FROM "sales"."orders_outbox_cursor" WHERE part = 0)) OR (pg_visible_in_snapshot(o.xid, (SELECT hi FROM "sales"."orders_outbox_cursor" WHERE part = 0)) AND o.id <= (SELECT after FROM "sales"."orders_outbox_cursor" WHERE part = 0)))
    ORDER BY o.xid, o.id LIMIT $2 FOR UPDATE OF o SKIP LOCKED) AS l
    WHERE l.created_at < now() - $1 * interval '1 microsecond'
)
DELETE FROM "sales"."orders_outbox" WHERE id IN (SELECT id FROM sent UNION ALL SELECT id FROM logged);

-- purge_inbox
-- params: bigint, bigint
-- under: SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off
WITH doomed AS MATERIALIZED (
    SELECT consumer, idempotency_key FROM "sales"."orders_outbox_inbox" WHERE processed_at < now() - $1 * interval '1 microsecond'
    ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED
)
DELETE FROM "sales"."orders_outbox_inbox" WHERE (consumer, idempotency_key) IN (SELECT consumer, idempotency_key FROM doomed);

-- claim
-- params: bigint, bigint, integer, bigint, bigint, bigint[]
-- under: SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off
WITH heads AS MATERIALIZED (
    SELECT id, aggregate_key, attempts, octet_length(payload) + octet_length(headers::text) AS bytes FROM "sales"."orders_outbox" o
    WHERE status = 'pending' AND available_at <= now()
      AND (lease_until IS NULL OR lease_until <= now())
      AND id <> ALL($6::bigint[])
      AND (aggregate_key IS NULL OR NOT EXISTS (
          SELECT 1 FROM "sales"."orders_outbox" p WHERE p.status = 'pending'
          AND p.aggregate_key = o.aggregate_key AND p.id < o.id))
    ORDER BY id LIMIT $1
    FOR UPDATE SKIP LOCKED
), share AS MATERIALIZED (
    SELECT least($4, ($1 - count(*)) / greatest(count(*) FILTER (WHERE aggregate_key IS NOT NULL AND attempts = 0), 1)) AS per_run FROM heads
), succ AS MATERIALIZED (
    SELECT h.id AS head, n.id, n.pos, n.ready, n.leased, n.bytes,
           h.attempts = 0 AND n.pos <= (SELECT per_run FROM share) AS in_run
    FROM heads h CROSS JOIN LATERAL (
        SELECT s.id, row_number() OVER (ORDER BY s.id) AS pos,
               s.available_at <= now() AND (s.lease_until IS NULL OR s.lease_until <= now()) AS ready,
               coalesce(s.lease_until > now(), false) AS leased,
               octet_length(s.payload) + octet_length(s.headers::text) AS bytes
        FROM "sales"."orders_outbox" s WHERE s.status = 'pending'
        AND s.aggregate_key = h.aggregate_key AND s.id > h.id
        ORDER BY s.id LIMIT greatest((SELECT per_run FROM share), 8 - 1) + 1
    ) AS n
    WHERE h.aggregate_key IS NOT NULL
), locked AS MATERIALIZED (
    SELECT id FROM "sales"."orders_outbox"
    WHERE id = ANY (ARRAY(SELECT id FROM succ WHERE in_run AND ready))
      AND status = 'pending' AND available_at <= now()
      AND (lease_until IS NULL OR lease_until <= now())
      AND id <> ALL($6::bigint[])
    FOR UPDATE SKIP LOCKED
), cut AS MATERIALIZED (
    SELECT s.head,
           min(s.pos) FILTER (WHERE NOT (s.in_run AND s.ready AND l.id IS NOT NULL)) AS stop,
           bool_or(s.leased OR (s.in_run AND s.ready AND l.id IS NULL)) AS held
    FROM succ s LEFT JOIN locked l ON l.id = s.id
    GROUP BY s.head
), chosen AS (
    SELECT h.id, true AS head, h.bytes FROM heads h LEFT JOIN cut c ON c.head = h.id
    WHERE c.held IS NOT TRUE
    UNION ALL
    SELECT s.id, false, s.bytes FROM succ s JOIN cut c ON c.head = s.head
    WHERE NOT c.held AND s.in_run AND (c.stop IS NULL OR s.pos < c.stop)
), due AS MATERIALIZED (
    SELECT array_agg(id) AS ids, coalesce(array_agg(id) FILTER (WHERE NOT head), '{}') AS runs FROM (
        SELECT id, head, sum(bytes) OVER (ORDER BY id) AS total, row_number() OVER (ORDER BY id) AS n FROM chosen
    ) AS b WHERE n = 1 OR total <= $5
)
UPDATE "sales"."orders_outbox" t SET
    attempts = CASE WHEN t.id = ANY((SELECT runs FROM due)::bigint[]) THEN t.attempts ELSE least(t.attempts, 2147483646) + 1 END,
    fencing_token = least(t.fencing_token, 9223372036854775806) + 1,
    lease_until = CASE WHEN t.attempts >= $3 AND NOT t.id = ANY((SELECT runs FROM due)::bigint[]) THEN NULL ELSE now() + $2 * interval '1 microsecond' END,
    status = CASE WHEN t.attempts >= $3 AND NOT t.id = ANY((SELECT runs FROM due)::bigint[]) THEN 'dead' ELSE 'pending' END,
    dead_at = CASE WHEN t.attempts >= $3 AND NOT t.id = ANY((SELECT runs FROM due)::bigint[]) THEN now() END,
    last_error = CASE WHEN t.attempts >= $3 AND NOT t.id = ANY((SELECT runs FROM due)::bigint[]) THEN 'claimed ' || (least(t.attempts, 2147483646) + 1) || ' times without an outcome (relay crashed or lease expired); max_attempts is ' || $3 ELSE t.last_error END
WHERE t.id = ANY((SELECT ids FROM due)::bigint[]) AND t.status = 'pending'
RETURNING t.id, t.idempotency_key AS key, t.topic, t.aggregate_key, t.payload, t.content_type, t.headers::text AS headers, t.attempts, t.fencing_token, CASE WHEN t.created_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59+00' THEN t.created_at END AS created_at, t.status, NOT t.id = ANY((SELECT runs FROM due)::bigint[]) AS head;

-- due
SELECT (SELECT o.id FROM "sales"."orders_outbox" o WHERE o.status = 'pending' AND o.available_at <= now() AND (o.lease_until IS NULL OR o.lease_until <= now()) AND (o.aggregate_key IS NULL OR NOT EXISTS (SELECT 1 FROM "sales"."orders_outbox" p WHERE p.status = 'pending' AND p.aggregate_key = o.aggregate_key AND p.id < o.id)) ORDER BY o.id LIMIT 1) IS NOT NULL AS due;

-- record_outcomes
-- params: bigint[], bigint[], text[], bigint[], text[], integer[]
-- under: SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off; SET LOCAL enable_nestloop = off
UPDATE "sales"."orders_outbox" t SET
    status = CASE o.kind WHEN 'sent' THEN 'sent' WHEN 'dead' THEN 'dead' ELSE 'pending' END,
    sent_at = CASE WHEN o.kind = 'sent' THEN now() ELSE t.sent_at END,
    dead_at = CASE WHEN o.kind = 'dead' THEN now() ELSE t.dead_at END,
    available_at = CASE WHEN o.kind = 'retry' THEN now() + o.delay_us * interval '1 microsecond' ELSE t.available_at END,
    attempts = CASE WHEN o.kind = 'release' THEN greatest(o.attempt - 1, 0) ELSE o.attempt END,
    last_error = CASE WHEN o.kind IN ('retry', 'dead') THEN o.err ELSE t.last_error END,
    lease_until = NULL
FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::bigint[], $5::text[], $6::integer[]) AS o(id, token, kind, delay_us, err, attempt)
WHERE t.id = ANY($1::bigint[]) AND t.id = o.id AND t.fencing_token = o.token AND t.status = 'pending'
RETURNING t.id;

-- log take
-- params: text, bigint
UPDATE "sales"."orders_outbox_cursor" SET
    token = CASE WHEN owner = $1 THEN token ELSE least(token, 9223372036854775806) + 1 END,
    page_attempts = CASE WHEN owner IS NOT NULL AND owner <> $1 AND after < ceiling THEN least(page_attempts, 2147483646) + 1 ELSE page_attempts END,
    owner = $1, lease_until = now() + $2 * interval '1 microsecond'
WHERE part = 0 AND (owner = $1 OR owner IS NULL OR lease_until <= now()) AND set_config('synchronous_commit', 'on', true) IS NOT NULL
RETURNING lo::text AS lo, hi::text AS hi, ceiling, after, walk_from, tick, page_attempts, token;

-- log open_tick
-- params: bigint, bigint, text, bigint, bigint
-- under: SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off
WITH s AS MATERIALIZED (SELECT pg_current_snapshot() AS cur),
n AS MATERIALIZED (
    SELECT min(o.id) AS floor, max(o.id) AS ceiling, min(o.id) FILTER (WHERE o.xid >= (SELECT pg_snapshot_xmax($3::pg_snapshot))) AS fresh
    FROM (
        SELECT i.id, i.xid FROM "sales"."orders_outbox" i WHERE i.status = 'logged' AND i.xid = ANY(ARRAY(SELECT pg_snapshot_xip($3::pg_snapshot)))
        UNION ALL
        SELECT i.id, i.xid FROM "sales"."orders_outbox" i WHERE i.status = 'logged' AND i.xid >= pg_snapshot_xmax($3::pg_snapshot)
    ) AS o, s
    WHERE NOT pg_visible_in_snapshot(o.xid, (SELECT $3::pg_snapshot)) AND pg_visible_in_snapshot(o.xid, s.cur)
), opened AS (
    UPDATE "sales"."orders_outbox_cursor" c SET lo = c.hi, hi = s.cur, ceiling = n.ceiling, after = n.floor - 1, walk_from = coalesce(n.fresh - 1, n.ceiling), tick = c.tick + 1, page_attempts = 0, lease_until = now() + $5 * interval '1 microsecond'
    FROM s, n
    WHERE c.part = 0 AND c.token = $1 AND c.tick = $2 AND c.after = $4 AND c.ceiling = $4 AND c.hi::text = $3 AND n.floor IS NOT NULL
    RETURNING c.lo::text AS lo, c.hi::text AS hi, c.ceiling, c.after, c.walk_from, c.tick, c.page_attempts, c.token
)
SELECT lo, hi, ceiling, after, walk_from, tick, page_attempts, token, true AS opened FROM opened
UNION ALL
SELECT lo::text AS lo, hi::text AS hi, ceiling, after, walk_from, tick, page_attempts, token, false FROM "sales"."orders_outbox_cursor" WHERE part = 0 AND NOT EXISTS (SELECT 1 FROM opened);

-- log read_page
-- params: bigint, bigint, text, text, bigint, bigint
-- under: SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off
SELECT id, key, topic, aggregate_key, payload, content_type, headers, created_at, delayed, read FROM (
    SELECT p.*, sum(p.bytes) OVER (ORDER BY p.id) AS total, row_number() OVER (ORDER BY p.id) AS n, count(*) OVER () AS read FROM (
SELECT o.id, o.idempotency_key AS key, o.topic, o.aggregate_key, o.payload, o.content_type, o.headers::text AS headers, CASE WHEN o.created_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59+00' THEN o.created_at END AS created_at, o.available_at > now() AS delayed, octet_length(o.payload) + octet_length(o.headers::text) AS bytes
        FROM "sales"."orders_outbox" o WHERE o.id > $1 AND o.id <= $2 AND (o.status || '') = 'logged'
        AND pg_visible_in_snapshot(o.xid, (SELECT $4::pg_snapshot)) AND NOT pg_visible_in_snapshot(o.xid, (SELECT $3::pg_snapshot))
        ORDER BY o.id LIMIT $5
    ) AS p
) AS q WHERE n < $5 AND (n = 1 OR total <= $6) ORDER BY id;

-- log read_late_page
-- params: bigint, bigint, bigint, text, text, bigint, bigint
-- under: SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off
SELECT id, key, topic, aggregate_key, payload, content_type, headers, created_at, delayed, read FROM (
    SELECT p.*, sum(p.bytes) OVER (ORDER BY p.id) AS total, row_number() OVER (ORDER BY p.id) AS n, count(*) OVER () AS read FROM (
SELECT * FROM (
        (SELECT r.* FROM pg_snapshot_xip($4::pg_snapshot) AS x(xid)
        CROSS JOIN LATERAL (SELECT o.id, o.idempotency_key AS key, o.topic, o.aggregate_key, o.payload, o.content_type, o.headers::text AS headers, CASE WHEN o.created_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59+00' THEN o.created_at END AS created_at, o.available_at > now() AS delayed, octet_length(o.payload) + octet_length(o.headers::text) AS bytes FROM "sales"."orders_outbox" o WHERE o.status = 'logged' AND o.xid = x.xid AND o.id > $1 AND o.id <= $2 ORDER BY o.id LIMIT $6) AS r
        WHERE pg_visible_in_snapshot(x.xid, (SELECT $5::pg_snapshot)) ORDER BY r.id LIMIT $6)
        UNION ALL
        (SELECT o.id, o.idempotency_key AS key, o.topic, o.aggregate_key, o.payload, o.content_type, o.headers::text AS headers, CASE WHEN o.created_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59+00' THEN o.created_at END AS created_at, o.available_at > now() AS delayed, octet_length(o.payload) + octet_length(o.headers::text) AS bytes
        FROM "sales"."orders_outbox" o WHERE o.id > $2 AND o.id <= $3 AND (o.status || '') = 'logged'
        AND pg_visible_in_snapshot(o.xid, (SELECT $5::pg_snapshot)) AND NOT pg_visible_in_snapshot(o.xid, (SELECT $4::pg_snapshot))
        ORDER BY o.id LIMIT $6)
    ) AS u ORDER BY u.id LIMIT $6
    ) AS p
) AS q WHERE n < $6 AND (n = 1 OR total <= $7) ORDER BY id;

-- log pending_aggregates
-- params: text[], bigint[]
-- under: SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off; SET LOCAL plan_cache_mode = force_custom_plan
SELECT DISTINCT aggregate_key AS key FROM "sales"."orders_outbox" WHERE status = 'pending' AND aggregate_key = ANY($1::text[]) AND id <> ALL($2::bigint[]);

-- log advance
-- params: bigint, bigint, bigint, bigint, integer, bigint
WITH moved AS (
    UPDATE "sales"."orders_outbox_cursor" SET after = $4, page_attempts = $5, lease_until = now() + $6 * interval '1 microsecond'
    WHERE part = 0 AND token = $1 AND tick = $2 AND after = $3 AND set_config('synchronous_commit', 'on', true) IS NOT NULL
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM moved) AS moved, (SELECT c.token FROM "sales"."orders_outbox_cursor" c WHERE c.part = 0) AS token;

-- log hand_over
-- params: bigint[], text[], bigint[], text[], integer[]
-- under: SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off; SET LOCAL plan_cache_mode = force_custom_plan
UPDATE "sales"."orders_outbox" t SET
    status = CASE o.kind WHEN 'dead' THEN 'dead' ELSE 'pending' END,
    dead_at = CASE WHEN o.kind = 'dead' THEN now() END,
    available_at = CASE WHEN o.kind = 'retry' THEN now() + o.delay_us * interval '1 microsecond' ELSE t.available_at END,
    attempts = o.attempt,
    last_error = o.err
FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[], $5::integer[]) AS o(id, kind, delay_us, err, attempt)
WHERE t.id = ANY($1::bigint[]) AND t.id = o.id AND t.status = 'logged';

-- log give_back
-- params: text, bigint
UPDATE "sales"."orders_outbox_cursor" SET owner = NULL, lease_until = now() WHERE part = 0 AND owner = $1 AND token = $2 AND set_config('synchronous_commit', 'on', true) IS NOT NULL;

-- log holder
SELECT owner, greatest(0, floor(extract(epoch FROM lease_until - now()) * 1000000))::bigint AS lease_left_us FROM "sales"."orders_outbox_cursor" WHERE part = 0;

-- log committed
-- params: text
SELECT (SELECT o.xid FROM "sales"."orders_outbox" o WHERE o.status = 'logged' AND o.xid >= (SELECT pg_snapshot_xmax($1::pg_snapshot)) AND pg_visible_in_snapshot(o.xid, pg_current_snapshot()) ORDER BY o.xid LIMIT 1) IS NOT NULL OR (SELECT o.xid FROM "sales"."orders_outbox" o WHERE o.status = 'logged' AND o.xid = ANY(ARRAY(SELECT pg_snapshot_xip($1::pg_snapshot))) AND pg_visible_in_snapshot(o.xid, pg_current_snapshot()) ORDER BY o.xid LIMIT 1) IS NOT NULL AS found;

-- watch
SELECT pg_try_advisory_lock(1869968503, '"sales"."orders_outbox"'::regclass::oid::int4) AS got, EXISTS (
    SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2
    AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
    AND classid = 1869968503::oid AND objid = '"sales"."orders_outbox"'::regclass::oid::int4::oid
    AND mode = 'ExclusiveLock' AND granted AND pid <> pg_backend_pid()
) AS watched;

-- unwatch
SELECT pg_advisory_unlock(1869968503, '"sales"."orders_outbox"'::regclass::oid::int4) AS released;

-- listen
LISTEN "sales.orders_outbox_wake";

-- relay_state
-- params: text, boolean, bigint, bigint
WITH gone AS (
    DELETE FROM "sales"."orders_outbox_relays" WHERE expires_at < now() - interval '1 minute' AND relay_id <> $1
)
INSERT INTO "sales"."orders_outbox_relays" (relay_id, idle, expires_at, blocked_since) VALUES ($1, $2, now() + $3 * interval '1 microsecond', now() - $4 * interval '1 microsecond') ON CONFLICT (relay_id) DO UPDATE SET idle = excluded.idle, expires_at = excluded.expires_at, blocked_since = excluded.blocked_since;

-- relay_gone
-- params: text
DELETE FROM "sales"."orders_outbox_relays" WHERE relay_id = $1 OR expires_at < now();
