//! Diesel `table!` definitions for the default table names (`outbox`, `outbox_inbox`,
//! `outbox_migrations`, `outbox_relays`), for typed reads with Diesel's query builder.
//!
//! Write through [`Outbox`](crate::Outbox) rather than inserting here directly: enqueue
//! validates, fills the key and wakes relays. A custom table name has no `table!` of its
//! own (Diesel's table names are fixed at compile time); all of the crate's own statements
//! are rendered for the configured name instead.

diesel::table! {
    /// The outbox: one row per message.
    outbox (id) {
        /// Enqueue order.
        id -> BigInt,
        /// Carried by every delivery (AMQP message id); unique.
        idempotency_key -> Text,
        /// Routing key at the broker.
        topic -> Text,
        /// Messages sharing one are published one at a time, in id order.
        aggregate_key -> Nullable<Text>,
        /// The message body.
        payload -> Bytea,
        /// MIME type of the payload.
        content_type -> Nullable<Text>,
        /// User headers: a JSON object of strings.
        headers -> Jsonb,
        /// `pending`, `sent` or `dead`.
        status -> Text,
        /// Attempts used from the failure budget.
        attempts -> Integer,
        /// Incremented by every claim, never reset; outcomes are fenced by it.
        fencing_token -> BigInt,
        /// Not claimed before this time (delay and backoff).
        available_at -> Timestamptz,
        /// The current claim's lease.
        lease_until -> Nullable<Timestamptz>,
        /// The last publish error.
        last_error -> Nullable<Text>,
        /// Enqueue time.
        created_at -> Timestamptz,
        /// When the broker confirmed it.
        sent_at -> Nullable<Timestamptz>,
        /// When it became a dead letter.
        dead_at -> Nullable<Timestamptz>,
    }
}

diesel::table! {
    /// Consumers' dedupe records.
    outbox_inbox (consumer, idempotency_key) {
        /// The consumer's name.
        consumer -> Text,
        /// The processed message's key.
        idempotency_key -> Text,
        /// When it was processed.
        processed_at -> Timestamptz,
    }
}

diesel::table! {
    /// Applied schema versions of the outbox.
    outbox_migrations (version) {
        /// Schema version.
        version -> Integer,
        /// When it was applied.
        applied_at -> Timestamptz,
    }
}

diesel::table! {
    /// Running relays, which keep their record alive while they run (unlogged: rebuilt by
    /// the relays after a crash of the database).
    outbox_relays (relay_id) {
        /// A relay run's random id.
        relay_id -> Text,
        /// Whether it has nothing to do and waits for a wake-up.
        idle -> Bool,
        /// The record lapses then unless renewed.
        expires_at -> Timestamptz,
        /// Since when its broker has been unreachable; `NULL` while it is reachable.
        blocked_since -> Nullable<Timestamptz>,
    }
}

diesel::allow_tables_to_appear_in_same_query!(outbox, outbox_inbox);
