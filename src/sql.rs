//! Every SQL statement the crate runs, rendered once per table name.
//!
//! Identifiers come only from a validated [`TableName`] and are always quoted; every value
//! is a bound parameter. Durations are bound as microseconds (`bigint`) and turned into
//! intervals by PostgreSQL, so all times come from the database clock.

use crate::statement::Statement;
use crate::table::TableName;

/// Statements of each migration version, in order. Version numbers start at 1.
pub(crate) struct Statements {
    /// `CREATE SCHEMA`, when the table is schema-qualified.
    pub(crate) create_schema: Option<String>,
    pub(crate) create_migrations: String,
    pub(crate) select_versions: String,
    pub(crate) record_version: Statement,
    pub(crate) migrations: Vec<Migration>,

    pub(crate) enqueue: Statement,
    pub(crate) enqueue_notify: Statement,
    pub(crate) enqueue_one: Statement,
    pub(crate) enqueue_one_notify: Statement,
    pub(crate) dedupe: Statement,

    pub(crate) stats: Statement,
    pub(crate) redrive: Statement,
    pub(crate) dead_letters: Statement,
    pub(crate) purge_sent: Statement,
    pub(crate) purge_inbox: Statement,

    pub(crate) claim: Statement,
    pub(crate) due: Statement,
    pub(crate) record_outcomes: Statement,
    pub(crate) listen: String,
    pub(crate) watch: Statement,
    pub(crate) unwatch: Statement,
    pub(crate) relay_state: Statement,
    pub(crate) relay_gone: Statement,
}

/// One schema version: the statements that apply it and those that take it back.
pub(crate) struct Migration {
    pub(crate) up: Vec<String>,
    pub(crate) down: Vec<String>,
}

/// Outcome kinds bound into [`Statements::record_outcomes`].
pub(crate) const OUTCOME_SENT: &str = "sent";
pub(crate) const OUTCOME_RETRY: &str = "retry";
pub(crate) const OUTCOME_DEAD: &str = "dead";
pub(crate) const OUTCOME_RELEASE: &str = "release";

/// The first key of the wake lock an idle relay holds (`pg_advisory_lock(int, int)`); the
/// second is the outbox table's oid. "outw" in ASCII. See the crate docs, "Wake-up".
pub const WAKE_LOCK_CLASS: i32 = 0x6f75_7477;

/// The table's oid as the wake lock's second key: the same whatever the spelling of the
/// name, resolved when the statement is planned.
fn wake_lock_table(table: &TableName) -> String {
    format!("'{}'::regclass::oid::int4", table.quoted())
}

fn wake_lock_key(table: &TableName) -> String {
    format!("{WAKE_LOCK_CLASS}, {}", wake_lock_table(table))
}

/// A claim reads at least this many successors of an aggregate head, to see whether another
/// relay holds leases further down that aggregate.
pub(crate) const CHECK_WINDOW: usize = 8;

/// Beyond this many sent rows `stats` reports the planner's estimate instead of counting.
pub(crate) const SENT_EXACT_LIMIT: i64 = 100_000;

impl Statements {
    pub(crate) fn render(table: &TableName) -> Self {
        let t = table.quoted();
        let inbox = table.quoted_with("_inbox");
        let migrations_table = table.quoted_with("_migrations");
        let o = |suffix: &str| table.object(suffix);

        let v1 = vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (\n\
                 \x20   id bigint GENERATED ALWAYS AS IDENTITY (SEQUENCE NAME {seq}),\n\
                 \x20   idempotency_key text NOT NULL,\n\
                 \x20   topic text NOT NULL,\n\
                 \x20   aggregate_key text,\n\
                 \x20   payload bytea NOT NULL,\n\
                 \x20   content_type text,\n\
                 \x20   headers jsonb NOT NULL DEFAULT '{{}}'::jsonb,\n\
                 \x20   status text NOT NULL DEFAULT 'pending',\n\
                 \x20   attempts integer NOT NULL DEFAULT 0,\n\
                 \x20   fencing_token bigint NOT NULL DEFAULT 0,\n\
                 \x20   available_at timestamptz NOT NULL DEFAULT now(),\n\
                 \x20   lease_until timestamptz,\n\
                 \x20   last_error text,\n\
                 \x20   created_at timestamptz NOT NULL DEFAULT now(),\n\
                 \x20   sent_at timestamptz,\n\
                 \x20   dead_at timestamptz,\n\
                 \x20   CONSTRAINT {pkey} PRIMARY KEY (id),\n\
                 \x20   CONSTRAINT {unique} UNIQUE (idempotency_key),\n\
                 \x20   CONSTRAINT {check} CHECK (status IN ('pending', 'sent', 'dead'))\n\
                 ) WITH (fillfactor = 70)",
                seq = table.quoted_with("_id_seq"),
                pkey = o("_pkey"),
                unique = o("_key_unique"),
                check = o("_status_check"),
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {t} (id) WHERE status = 'pending'",
                o("_pending_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {t} (aggregate_key, id) \
                 WHERE status = 'pending' AND aggregate_key IS NOT NULL",
                o("_aggregate_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {t} (sent_at) WHERE status = 'sent'",
                o("_sent_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {t} (id) WHERE status = 'dead'",
                o("_dead_idx")
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {inbox} (\n\
                 \x20   consumer text NOT NULL,\n\
                 \x20   idempotency_key text NOT NULL,\n\
                 \x20   processed_at timestamptz NOT NULL DEFAULT now(),\n\
                 \x20   CONSTRAINT {pkey} PRIMARY KEY (consumer, idempotency_key)\n\
                 )",
                pkey = o("_inbox_pkey"),
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {inbox} (processed_at)",
                o("_inbox_processed_idx")
            ),
            // Running relays: idle or not (for operators; writers go by the wake lock).
            // Unlogged: it is rebuilt by the relays themselves after a crash.
            format!(
                "CREATE UNLOGGED TABLE IF NOT EXISTS {relays} (\n\
                 \x20   relay_id text NOT NULL,\n\
                 \x20   idle boolean NOT NULL,\n\
                 \x20   expires_at timestamptz NOT NULL,\n\
                 \x20   CONSTRAINT {pkey} PRIMARY KEY (relay_id)\n\
                 )",
                relays = table.quoted_with("_relays"),
                pkey = o("_relays_pkey"),
            ),
        ];

        let relays = table.quoted_with("_relays");
        let v1_down = vec![
            format!("DROP TABLE IF EXISTS {relays}"),
            format!("DROP TABLE IF EXISTS {inbox}"),
            format!("DROP TABLE IF EXISTS {t}"),
            format!("DELETE FROM {migrations_table} WHERE version = 1"),
        ];
        // Version 2: relays record when their broker became unreachable (for `stats`).
        let v2 = Migration {
            up: vec![format!(
                "ALTER TABLE {relays} ADD COLUMN IF NOT EXISTS blocked_since timestamptz"
            )],
            down: vec![
                format!("ALTER TABLE {relays} DROP COLUMN IF EXISTS blocked_since"),
                format!("DELETE FROM {migrations_table} WHERE version = 2"),
            ],
        };
        let enqueue_cte = format!(
            "WITH m AS (\n\
             \x20   SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], \
             $5::text[], $6::jsonb[], $7::bigint[]) AS m(k, topic, agg, payload, ct, headers, delay_us)\n\
             ), dup AS (\n\
             \x20   SELECT idempotency_key AS k FROM {t} WHERE idempotency_key = ANY($1::text[])\n\
             ), ins AS (\n\
             \x20   INSERT INTO {t} (idempotency_key, topic, aggregate_key, payload, content_type, headers, available_at)\n\
             \x20   SELECT k, topic, agg, payload, ct, headers, now() + delay_us * interval '1 microsecond'\n\
             \x20   FROM m WHERE NOT EXISTS (SELECT 1 FROM dup)\n\
             \x20   ON CONFLICT (idempotency_key) DO NOTHING\n\
             \x20   RETURNING idempotency_key AS k\n\
             )"
        );
        let enqueue_tail = "SELECT k AS key, true AS inserted FROM ins \
                            UNION ALL SELECT k AS key, false AS inserted FROM dup";
        let enqueue = format!("{enqueue_cte}\n{enqueue_tail}");
        // pg_notify is queued in the transaction and delivered only on commit; identical
        // notifications in one transaction collapse into one. A notifying commit takes a
        // cluster-wide lock, so writers notify only while some relay is idle and listening:
        // a busy relay finds new rows by itself.
        // Whether a relay is idle is decided by the wake lock, not by reading a table: an
        // idle relay holds it exclusively, so a writer whose shared try fails notifies. A
        // writer whose try succeeds holds the shared lock until it commits, and a relay going
        // idle cannot take the lock before that commit, and looks once more when it has it:
        // no wake-up is lost, whatever the isolation level or however long the transaction.
        let wake_key = wake_lock_key(table);
        let no_watcher = format!("pg_try_advisory_xact_lock_shared({wake_key})");
        let enqueue_notify = format!(
            "{enqueue_cte}, wake AS (\n\
             \x20   SELECT pg_notify($8, '') FROM (SELECT 1 FROM ins LIMIT 1) AS any_ins\n\
             \x20   WHERE NOT {no_watcher}\n\
             )\n\
             SELECT r.key, r.inserted FROM ({enqueue_tail}) AS r \
             CROSS JOIN (SELECT count(*) FROM wake) AS w"
        );
        // One message: a plain INSERT (a duplicate key returns no row). Cheaper to plan and
        // run than the arrays above, and the common case.
        let one_cte = format!(
            "WITH ins AS (\n\
             \x20   INSERT INTO {t} (idempotency_key, topic, aggregate_key, payload, content_type, headers, available_at)\n\
             \x20   VALUES ($1, $2, $3, $4, $5, $6, now() + $7 * interval '1 microsecond')\n\
             \x20   ON CONFLICT (idempotency_key) DO NOTHING\n\
             \x20   RETURNING idempotency_key AS k\n\
             )"
        );
        let enqueue_one = format!("{one_cte}\nSELECT k AS key, true AS inserted FROM ins");
        let enqueue_one_notify = format!(
            "{one_cte}, wake AS (\n\
             \x20   SELECT pg_notify($8, '') FROM ins\n\
             \x20   WHERE NOT {no_watcher}\n\
             )\n\
             SELECT k AS key, true AS inserted FROM ins CROSS JOIN (SELECT count(*) FROM wake) AS w"
        );

        Statements {
            create_schema: table
                .schema()
                .map(|s| format!("CREATE SCHEMA IF NOT EXISTS \"{s}\"")),
            create_migrations: format!(
                "CREATE TABLE IF NOT EXISTS {migrations_table} (\n\
                 \x20   version integer NOT NULL,\n\
                 \x20   applied_at timestamptz NOT NULL DEFAULT now(),\n\
                 \x20   CONSTRAINT {pkey} PRIMARY KEY (version)\n\
                 )",
                pkey = o("_migrations_pkey"),
            ),
            select_versions: format!("SELECT version FROM {migrations_table} ORDER BY version"),
            record_version: Statement::new(format!(
                "INSERT INTO {migrations_table} (version) VALUES ($1) ON CONFLICT DO NOTHING"
            )),
            migrations: vec![
                Migration {
                    up: v1,
                    down: v1_down,
                },
                v2,
            ],

            enqueue: Statement::new(enqueue),
            enqueue_notify: Statement::new(enqueue_notify),
            enqueue_one: Statement::new(enqueue_one),
            enqueue_one_notify: Statement::new(enqueue_one_notify),
            dedupe: Statement::new(format!(
                "INSERT INTO {inbox} (consumer, idempotency_key) VALUES ($1, $2) \
                 ON CONFLICT DO NOTHING RETURNING true AS inserted"
            )),

            stats: Statement::new(format!(
                "SELECT\n\
                 \x20   (SELECT count(*) FROM {t} WHERE status = 'pending' \
                 AND (lease_until IS NULL OR lease_until <= now())) AS pending,\n\
                 \x20   (SELECT count(*) FROM {t} WHERE status = 'pending' \
                 AND lease_until > now()) AS in_flight,\n\
                 \x20   (SELECT count(*) FROM (SELECT 1 FROM {t} WHERE status = 'sent' \
                 LIMIT {SENT_EXACT_LIMIT}) AS s) AS sent_counted,\n\
                 \x20   (SELECT greatest(reltuples, 0)::bigint FROM pg_class \
                 WHERE oid = to_regclass($1)) AS sent_estimate,\n\
                 \x20   (SELECT count(*) FROM {t} WHERE status = 'dead') AS dead,\n\
                 \x20   (SELECT (extract(epoch FROM now() - min(created_at)) * 1000000)::bigint \
                 FROM {t} WHERE status = 'pending' AND available_at <= now()) AS lag_us,\n\
                 \x20   (SELECT (extract(epoch FROM now() - min(blocked_since)) * 1000000)::bigint \
                 FROM {relays} WHERE expires_at > now()) AS blocked_us"
            )),
            redrive: Statement::new(format!(
                "UPDATE {t} SET status = 'pending', attempts = 0, available_at = now(), \
                 lease_until = NULL, dead_at = NULL \
                 WHERE status = 'dead' AND (cardinality($1::text[]) = 0 OR idempotency_key = ANY($1)) \
                 RETURNING idempotency_key AS key"
            )),
            dead_letters: Statement::new(format!(
                "SELECT id, idempotency_key AS key, topic, aggregate_key, attempts, last_error, \
                 created_at, dead_at FROM {t} WHERE status = 'dead' ORDER BY id LIMIT $1"
            )),
            purge_sent: Statement::new(format!(
                "WITH doomed AS MATERIALIZED (\n\
                 \x20   SELECT id FROM {t} WHERE status = 'sent' \
                 AND sent_at < now() - $1 * interval '1 microsecond'\n\
                 \x20   ORDER BY sent_at LIMIT $2 FOR UPDATE SKIP LOCKED\n\
                 )\n\
                 DELETE FROM {t} WHERE id IN (SELECT id FROM doomed)"
            )),
            purge_inbox: Statement::new(format!(
                "WITH doomed AS MATERIALIZED (\n\
                 \x20   SELECT consumer, idempotency_key FROM {inbox} \
                 WHERE processed_at < now() - $1 * interval '1 microsecond'\n\
                 \x20   ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED\n\
                 )\n\
                 DELETE FROM {inbox} WHERE (consumer, idempotency_key) IN \
                 (SELECT consumer, idempotency_key FROM doomed)"
            )),

            // $1 batch size, $2 lease (µs), $3 max attempts, $4 longest run, $5 byte budget.
            //
            // Heads are pending rows with no older pending row in their aggregate. Behind
            // each aggregate head on its first attempt the claim also takes the run of its
            // due successors; the relay publishes such a run one message at a time. The
            // batch's room after the heads is shared out equally among the heads that may
            // take a run, so the rows read stay proportional to the batch, not to the
            // backlog of each aggregate.
            //
            // Another relay may hold (or be taking) leases on later rows of a head's
            // aggregate: after a redrive or a late commit put a row in front of rows already
            // in flight. So each head's next successors (its run, and at least 8) are read,
            // the run's members locked with SKIP LOCKED and checked again, and a head whose
            // window shows a live lease or a row someone else has locked is left alone. So
            // two relays never hold leases on rows of one aggregate, short of more than 7
            // rows redriven (or committed late) at once in front of rows in flight. A run is
            // cut at its first member that is not available.
            //
            // Heads are charged an attempt; run members are charged when published (their
            // outcome says so), so a crash mid-run costs only the head, and the head's next
            // claim comes without a run. A head claimed again after it has used up its
            // attempts without an outcome (a crash loop) goes dead here. Rows are cut, in id
            // order, at the byte budget (always at least one row); each run keeps a prefix.
            //
            // Nothing in a row's content can make this statement fail: counters saturate,
            // headers come back as text and the enqueue time only when chrono can hold it,
            // so an undecodable row dies alone in the relay (see `store::decode`).
            claim: Statement::new(format!(
                "WITH heads AS MATERIALIZED (\n\
                 \x20   SELECT id, aggregate_key, attempts, {bytes} AS bytes FROM {t} o\n\
                 \x20   WHERE status = 'pending' AND available_at <= now()\n\
                 \x20     AND (lease_until IS NULL OR lease_until <= now())\n\
                 \x20     AND (aggregate_key IS NULL OR NOT EXISTS (\n\
                 \x20         SELECT 1 FROM {t} p WHERE p.status = 'pending'\n\
                 \x20         AND p.aggregate_key = o.aggregate_key AND p.id < o.id))\n\
                 \x20   ORDER BY id LIMIT $1\n\
                 \x20   FOR UPDATE SKIP LOCKED\n\
                 ), share AS MATERIALIZED (\n\
                 \x20   SELECT least($4, ($1 - count(*)) / greatest(count(*) FILTER \
                 (WHERE aggregate_key IS NOT NULL AND attempts = 0), 1)) AS per_run FROM heads\n\
                 ), succ AS MATERIALIZED (\n\
                 \x20   SELECT h.id AS head, n.id, n.pos, n.ready, n.leased, n.bytes,\n\
                 \x20          h.attempts = 0 AND n.pos <= (SELECT per_run FROM share) AS in_run\n\
                 \x20   FROM heads h CROSS JOIN LATERAL (\n\
                 \x20       SELECT s.id, row_number() OVER (ORDER BY s.id) AS pos,\n\
                 \x20              s.available_at <= now() \
                 AND (s.lease_until IS NULL OR s.lease_until <= now()) AS ready,\n\
                 \x20              coalesce(s.lease_until > now(), false) AS leased,\n\
                 \x20              {s_bytes} AS bytes\n\
                 \x20       FROM {t} s WHERE s.status = 'pending'\n\
                 \x20       AND s.aggregate_key = h.aggregate_key AND s.id > h.id\n\
                 \x20       ORDER BY s.id LIMIT greatest((SELECT per_run FROM share), {CHECK_WINDOW} - 1) + 1\n\
                 \x20   ) AS n\n\
                 \x20   WHERE h.aggregate_key IS NOT NULL\n\
                 ), locked AS MATERIALIZED (\n\
                 \x20   SELECT id FROM {t}\n\
                 \x20   WHERE id = ANY (ARRAY(SELECT id FROM succ WHERE in_run AND ready))\n\
                 \x20     AND status = 'pending' AND available_at <= now()\n\
                 \x20     AND (lease_until IS NULL OR lease_until <= now())\n\
                 \x20   FOR UPDATE SKIP LOCKED\n\
                 ), cut AS MATERIALIZED (\n\
                 \x20   SELECT s.head,\n\
                 \x20          min(s.pos) FILTER (WHERE NOT (s.in_run AND s.ready AND l.id IS NOT NULL)) AS stop,\n\
                 \x20          bool_or(s.leased OR (s.in_run AND s.ready AND l.id IS NULL)) AS held\n\
                 \x20   FROM succ s LEFT JOIN locked l ON l.id = s.id\n\
                 \x20   GROUP BY s.head\n\
                 ), chosen AS (\n\
                 \x20   SELECT h.id, true AS head, h.bytes FROM heads h LEFT JOIN cut c ON c.head = h.id\n\
                 \x20   WHERE c.held IS NOT TRUE\n\
                 \x20   UNION ALL\n\
                 \x20   SELECT s.id, false, s.bytes FROM succ s JOIN cut c ON c.head = s.head\n\
                 \x20   WHERE NOT c.held AND s.in_run AND (c.stop IS NULL OR s.pos < c.stop)\n\
                 ), due AS MATERIALIZED (\n\
                 \x20   SELECT array_agg(id) AS ids, \
                 coalesce(array_agg(id) FILTER (WHERE NOT head), '{{}}') AS runs FROM (\n\
                 \x20       SELECT id, head, sum(bytes) OVER (ORDER BY id) AS total, \
                 row_number() OVER (ORDER BY id) AS n FROM chosen\n\
                 \x20   ) AS b WHERE n = 1 OR total <= $5\n\
                 )\n\
                 UPDATE {t} t SET\n\
                 \x20   attempts = CASE WHEN {run_member} THEN t.attempts ELSE {next_attempt} END,\n\
                 \x20   fencing_token = least(t.fencing_token, 9223372036854775806) + 1,\n\
                 \x20   lease_until = CASE WHEN {crash_loop} THEN NULL \
                 ELSE now() + $2 * interval '1 microsecond' END,\n\
                 \x20   status = CASE WHEN {crash_loop} THEN 'dead' ELSE 'pending' END,\n\
                 \x20   dead_at = CASE WHEN {crash_loop} THEN now() END,\n\
                 \x20   last_error = CASE WHEN {crash_loop} \
                 THEN 'claimed ' || ({next_attempt}) || ' times without an outcome \
                 (relay crashed or lease expired); max_attempts is ' || $3 \
                 ELSE t.last_error END\n\
                 WHERE t.id = ANY((SELECT ids FROM due)::bigint[]) AND t.status = 'pending'\n\
                 RETURNING t.id, t.idempotency_key AS key, t.topic, t.aggregate_key, t.payload, \
                 t.content_type, t.headers::text AS headers, t.attempts, t.fencing_token, \
                 CASE WHEN t.created_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59+00' \
                 THEN t.created_at END AS created_at, t.status, NOT {run_member} AS head",
                bytes = "octet_length(payload) + octet_length(headers::text)",
                s_bytes = "octet_length(s.payload) + octet_length(s.headers::text)",
                run_member = "t.id = ANY((SELECT runs FROM due)::bigint[])",
                next_attempt = "least(t.attempts, 2147483646) + 1",
                crash_loop =
                    "t.attempts >= $3 AND NOT t.id = ANY((SELECT runs FROM due)::bigint[])",
            )),
            // A cheap look for work, used while lingering between claims. As the first due
            // row in id order (not `EXISTS`, whose ORDER BY the planner drops), so the only
            // sensible plan walks the pending index and stops at the first match, whatever
            // the statistics say: a sequential scan would read the table's whole history.
            due: Statement::new(format!(
                "SELECT (SELECT o.id FROM {t} o WHERE o.status = 'pending' \
                 AND o.available_at <= now() AND (o.lease_until IS NULL OR o.lease_until <= now()) \
                 AND (o.aggregate_key IS NULL OR NOT EXISTS (SELECT 1 FROM {t} p \
                 WHERE p.status = 'pending' AND p.aggregate_key = o.aggregate_key AND p.id < o.id)) \
                 ORDER BY o.id LIMIT 1) IS NOT NULL AS due"
            )),
            // One statement for every outcome of a batch, fenced by token and status: a
            // relay whose lease was taken over updates nothing. `t.id = ANY($1)` bounds the
            // rows read to the batch whatever the planner estimates; it runs as a hash join
            // (see `store::RECORD_PLAN`), never as a nested loop rescanning the arrays.
            record_outcomes: Statement::new(format!(
                "UPDATE {t} t SET\n\
                 \x20   status = CASE o.kind WHEN '{OUTCOME_SENT}' THEN 'sent' \
                 WHEN '{OUTCOME_DEAD}' THEN 'dead' ELSE 'pending' END,\n\
                 \x20   sent_at = CASE WHEN o.kind = '{OUTCOME_SENT}' THEN now() ELSE t.sent_at END,\n\
                 \x20   dead_at = CASE WHEN o.kind = '{OUTCOME_DEAD}' THEN now() ELSE t.dead_at END,\n\
                 \x20   available_at = CASE WHEN o.kind = '{OUTCOME_RETRY}' \
                 THEN now() + o.delay_us * interval '1 microsecond' ELSE t.available_at END,\n\
                 \x20   attempts = CASE WHEN o.kind = '{OUTCOME_RELEASE}' \
                 THEN greatest(o.attempt - 1, 0) ELSE o.attempt END,\n\
                 \x20   last_error = CASE WHEN o.kind IN ('{OUTCOME_RETRY}', '{OUTCOME_DEAD}') \
                 THEN o.err ELSE t.last_error END,\n\
                 \x20   lease_until = NULL\n\
                 FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::bigint[], $5::text[], \
                 $6::integer[]) AS o(id, token, kind, delay_us, err, attempt)\n\
                 WHERE t.id = ANY($1::bigint[]) AND t.id = o.id AND t.fencing_token = o.token \
                 AND t.status = 'pending'\n\
                 RETURNING t.id"
            )),
            listen: format!("LISTEN \"{}\"", table.channel()),
            // The relay's side of the wake lock, on its LISTEN connection: try to become the
            // watcher, and if that fails, tell whether another relay is (then writers notify)
            // or writers hold it (then their commits must be looked for).
            watch: Statement::new(format!(
                "SELECT pg_try_advisory_lock({wake_key}) AS got, EXISTS (\n\
                 \x20   SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2\n\
                 \x20   AND database = (SELECT oid FROM pg_database WHERE datname = current_database())\n\
                 \x20   AND classid = {WAKE_LOCK_CLASS}::oid AND objid = {key}::oid\n\
                 \x20   AND mode = 'ExclusiveLock' AND granted AND pid <> pg_backend_pid()\n\
                 ) AS watched",
                key = wake_lock_table(table),
            )),
            unwatch: Statement::new(format!("SELECT pg_advisory_unlock({wake_key}) AS released")),
            // $1 relay id, $2 idle, $3 time to live (µs), $4 how long its broker has been
            // unreachable (µs, NULL when it is reachable). Records of relays gone for a
            // minute are removed on the way, so the table holds live relays only.
            relay_state: Statement::new(format!(
                "WITH gone AS (\n\
                 \x20   DELETE FROM {relays} WHERE expires_at < now() - interval '1 minute' \
                 AND relay_id <> $1\n\
                 )\n\
                 INSERT INTO {relays} (relay_id, idle, expires_at, blocked_since) \
                 VALUES ($1, $2, now() + $3 * interval '1 microsecond', \
                 now() - $4 * interval '1 microsecond') \
                 ON CONFLICT (relay_id) DO UPDATE SET idle = excluded.idle, \
                 expires_at = excluded.expires_at, blocked_since = excluded.blocked_since"
            )),
            relay_gone: Statement::new(format!(
                "DELETE FROM {relays} WHERE relay_id = $1 OR expires_at < now()"
            )),
        }
    }

    /// The statements a user's own migration tool should run, in order: the schema (if
    /// any), the version table, every migration, and the version records.
    pub(crate) fn all_migration_sql(&self) -> Vec<String> {
        let mut out = Vec::new();
        out.extend(self.create_schema.clone());
        out.push(self.create_migrations.clone());
        for (i, migration) in self.migrations.iter().enumerate() {
            out.extend(migration.up.iter().cloned());
            out.push(
                self.record_version
                    .text()
                    .replace("$1", &(i + 1).to_string()),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every statement the crate runs, as rendered for `table`, one after another under
    /// its name.
    fn snapshot(table: &str) -> String {
        let s = Statements::render(&TableName::parse(table).expect("a valid name"));
        let mut named: Vec<(String, String)> = vec![
            (
                "create_schema".into(),
                s.create_schema.clone().unwrap_or_default(),
            ),
            ("create_migrations".into(), s.create_migrations.clone()),
            ("select_versions".into(), s.select_versions.clone()),
            ("record_version".into(), s.record_version.text().to_owned()),
        ];
        for (version, migration) in (1..).zip(&s.migrations) {
            for (i, up) in migration.up.iter().enumerate() {
                named.push((format!("migration {version} up {i}"), up.clone()));
            }
            for (i, down) in migration.down.iter().enumerate() {
                named.push((format!("migration {version} down {i}"), down.clone()));
            }
        }
        for (name, statement) in [
            ("enqueue", &s.enqueue),
            ("enqueue_notify", &s.enqueue_notify),
            ("enqueue_one", &s.enqueue_one),
            ("enqueue_one_notify", &s.enqueue_one_notify),
            ("dedupe", &s.dedupe),
            ("stats", &s.stats),
            ("redrive", &s.redrive),
            ("dead_letters", &s.dead_letters),
            ("purge_sent", &s.purge_sent),
            ("purge_inbox", &s.purge_inbox),
            ("claim", &s.claim),
            ("due", &s.due),
            ("record_outcomes", &s.record_outcomes),
            ("watch", &s.watch),
            ("unwatch", &s.unwatch),
            ("relay_state", &s.relay_state),
            ("relay_gone", &s.relay_gone),
        ] {
            named.push((name.into(), statement.text().to_owned()));
        }
        named.push(("listen".into(), s.listen.clone()));
        named
            .into_iter()
            .map(|(name, text)| format!("-- {name}\n{text};\n"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Pins the text of every statement for a schema-qualified table, so that moving the
    /// statements around changes none of them. Rerun with `OUTBOX_WRITE_SNAPSHOT=1` after a
    /// change that means to.
    #[test]
    fn every_statement_matches_its_snapshot() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/snapshots/statements.sql"
        );
        let rendered = snapshot("sales.orders_outbox");
        if std::env::var_os("OUTBOX_WRITE_SNAPSHOT").is_some() {
            std::fs::write(path, &rendered).expect("write the snapshot");
        }
        let pinned = std::fs::read_to_string(path).expect("the snapshot exists");
        assert!(
            pinned == rendered,
            "the statements differ from tests/snapshots/statements.sql; if that is meant, \
             rerun with OUTBOX_WRITE_SNAPSHOT=1"
        );
    }
}
