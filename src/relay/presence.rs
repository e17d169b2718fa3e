//! Presence: relays record in `<table>_relays` when they are idle (renewed while it lasts)
//! and since when their broker has been unreachable, for operators and `stats`; a busy
//! relay's record says so once, then lapses. Writers do not read
//! it: they go by the wake lock (see `listener`).

use std::time::Duration;

use diesel::sql_types::{BigInt, Bool, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use tokio::sync::watch;
use tokio::time::Instant;

use super::Relay;
use crate::error::Result;
use crate::outbox::Outbox;
use crate::publisher::Publisher;
use crate::shutdown::or_stop;
use crate::sql::{Sql, TableName, micros, statement};

/// An idle (or blocked) relay renews its record in `<table>_relays` this often...
pub(super) const IDLE_REFRESH: Duration = Duration::from_secs(10);
/// ...and the record lapses after this long, so a crashed relay drops out of `stats`.
const IDLE_TTL: Duration = Duration::from_secs(35);

statement! {
    /// Upserts a relay's record; records of relays gone for a minute are removed on the
    /// way, so the table holds live relays only.
    pub(crate) struct RelayState {
        relay_id: Text = String,
        idle: Bool = bool,
        /// How long the record lives unless renewed.
        ttl_us: BigInt = i64,
        /// How long its broker has been unreachable (`NULL` when it is reachable).
        blocked_us: Nullable<BigInt> = Option<i64>,
    }
}

statement! {
    /// Removes a relay's record, and every expired one.
    pub(crate) struct RelayGone {
        relay_id: Text = String,
    }
}

/// The presence statements of one table.
#[derive(Debug, Clone)]
pub(crate) struct PresenceStatements {
    pub(crate) relay_state: Sql<RelayState>,
    pub(crate) relay_gone: Sql<RelayGone>,
}

impl PresenceStatements {
    pub(crate) fn render(table: &TableName) -> Self {
        let relays = table.quoted_with("_relays");
        PresenceStatements {
            relay_state: Sql::new(format!(
                "WITH gone AS (\n\
                 \x20   DELETE FROM {relays} WHERE expires_at < now() - interval '1 minute' \
                 AND relay_id <> {id}\n\
                 )\n\
                 INSERT INTO {relays} (relay_id, idle, expires_at, blocked_since) \
                 VALUES ({id}, {idle}, now() + {ttl} * interval '1 microsecond', \
                 now() - {blocked} * interval '1 microsecond') \
                 ON CONFLICT (relay_id) DO UPDATE SET idle = excluded.idle, \
                 expires_at = excluded.expires_at, blocked_since = excluded.blocked_since",
                id = RelayState::relay_id,
                idle = RelayState::idle,
                ttl = RelayState::ttl_us,
                blocked = RelayState::blocked_us,
            )),
            relay_gone: Sql::new(format!(
                "DELETE FROM {relays} WHERE relay_id = {} OR expires_at < now()",
                RelayGone::relay_id
            )),
        }
    }
}

impl Outbox {
    /// Upserts a relay's record: idle or not, and how long its broker has been unreachable.
    pub(crate) async fn set_relay_state(
        &self,
        conn: &mut AsyncPgConnection,
        relay_id: &str,
        idle: bool,
        ttl: Duration,
        blocked_for: Option<Duration>,
    ) -> Result<()> {
        self.statements()
            .presence
            .relay_state
            .bind(RelayState {
                relay_id: relay_id.to_owned(),
                idle,
                ttl_us: micros(ttl),
                blocked_us: blocked_for.map(micros),
            })
            .execute(conn)
            .await
            .map_err(|e| self.db_error(e))?;
        Ok(())
    }

    /// Deletes a relay's idle record, and every expired one.
    pub(crate) async fn remove_relay(
        &self,
        conn: &mut AsyncPgConnection,
        relay_id: &str,
    ) -> Result<()> {
        self.statements()
            .presence
            .relay_gone
            .bind(RelayGone {
                relay_id: relay_id.to_owned(),
            })
            .execute(conn)
            .await
            .map_err(|e| self.db_error(e))?;
        Ok(())
    }
}

/// How a run is named in `<table>_relays`, and its stop signal (a write never holds up a
/// shutdown).
pub(super) struct RunName<'a> {
    pub(super) id: &'a str,
    pub(super) stop: &'a watch::Receiver<bool>,
}

impl<P: Publisher> Relay<P> {
    /// Records in `<table>_relays` whether this run is idle (for operators: writers go by the
    /// wake lock). Returns whether that worked.
    pub(super) async fn mark_idle(&self, run: &RunName<'_>, idle: bool) -> bool {
        let blocked = self.inner.outage.since().map(|since| since.elapsed());
        self.write_state(run, idle, blocked).await
    }

    /// Keeps this run's outage in `<table>_relays` current: when it begins or ends, and
    /// every [`IDLE_REFRESH`] while it lasts (so its record does not lapse).
    pub(super) async fn sync_blocked(
        &self,
        run: &RunName<'_>,
        written: &mut (Option<Instant>, Instant),
    ) {
        let since = self.inner.outage.since();
        let due = since.is_some() && written.1.elapsed() >= IDLE_REFRESH;
        if since != written.0 || due {
            let blocked = since.map(|s| s.elapsed());
            // Tried, whether or not it worked: a failing write is tried again a refresh later,
            // not on every turn of the loop.
            self.write_state(run, false, blocked).await;
            *written = (since, Instant::now());
        }
    }

    pub(super) async fn write_state(
        &self,
        run: &RunName<'_>,
        idle: bool,
        blocked: Option<Duration>,
    ) -> bool {
        let inner = &self.inner;
        let writing = inner.store.set_state(run.id, idle, IDLE_TTL, blocked);
        let result = or_stop(run.stop, writing).await.unwrap_or(Ok(()));
        if let Err(e) = &result {
            tracing::debug!(table = %inner.outbox.table(), error = %e, idle, "recording relay state failed");
        }
        result.is_ok()
    }

    /// Removes this run's record in `<table>_relays` (and any expired ones).
    pub(super) async fn forget(&self, run: &RunName<'_>) {
        let inner = &self.inner;
        let result = inner.store.forget(run.id).await;
        if let Err(e) = result {
            tracing::debug!(table = %inner.outbox.table(), error = %e, "removing relay state failed");
        }
    }
}

#[cfg(test)]
impl crate::sql::Listed for PresenceStatements {
    fn listed(&self) -> Vec<(String, &str)> {
        let PresenceStatements {
            relay_state,
            relay_gone,
        } = self;
        vec![
            relay_state.named("relay_state"),
            relay_gone.named("relay_gone"),
        ]
    }
}
