//! Wake-up: LISTEN on a dedicated connection, reconnecting with backoff, and the wake lock
//! that tells writers a relay is idle.
//!
//! The protocol, in full (the writers' half is in the enqueue statement):
//! - A writer tries `pg_try_advisory_xact_lock_shared(class, table oid)` when its enqueue
//!   inserts a row. If the try fails, a relay is idle (it holds the lock exclusively), and
//!   the writer sends its NOTIFY, delivered when it commits. If the try succeeds, the writer
//!   holds the shared lock until its transaction ends and sends nothing.
//! - A relay going idle tries to take the lock exclusively on its LISTEN connection. It gets
//!   it only when no writer holds it shared: every writer that decided "no relay is idle"
//!   has committed or rolled back by then, so the one look the relay takes right after sees
//!   their rows. From then on every writer notifies, until the relay wakes and lets go.
//! - A relay that cannot get the lock learns why: another relay holds it (writers notify, so
//!   it can sleep, and tries again every [`COVERED_RETRY`] to take over when the other
//!   leaves), or writers do (it looks for their rows, and tries again, every
//!   [`WATCH_RETRY`]).
//!
//! Locks are not snapshots, so this holds at every isolation level and however long the
//! writer's transaction was open; the lock of a relay whose connection dies goes with it.

use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::time::Duration;

use diesel::QueryableByName;
use diesel::sql_types::Bool;
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use futures_util::StreamExt;
use tokio::sync::{Notify, watch};

use crate::backoff::Backoff;
use crate::connect::PgPool;
use crate::health::Vitals;
use crate::sql::{NoParams, Sql, TableName, WAKE_LOCK_CLASS};
use crate::streak::{Loudness, Streak};

const RECONNECT_MIN: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(30);
/// A silently dead connection delivers nothing; a round trip this often finds out.
const HEALTH_CHECK: Duration = Duration::from_secs(15);
/// A relay that wants to be idle while writers hold the wake lock tries again (and looks for
/// their rows) this often.
pub(crate) const WATCH_RETRY: Duration = Duration::from_millis(25);
/// While another relay holds the wake lock (writers notify, and this relay hears them too),
/// this one tries again this often, to take over if the other goes away.
const COVERED_RETRY: Duration = Duration::from_millis(100);
/// The health check gives up after this long.
const HEALTH_CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// What the listener can tell the relay about the wake lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Watch {
    /// Not asked to watch, or no connection.
    Off = 0,
    /// This relay holds the wake lock: writers notify it.
    Watching = 1,
    /// Another relay holds it: writers notify (and this relay hears it too).
    Covered = 2,
    /// Writers hold it shared: their commits will not notify; look for them.
    Contended = 3,
}

impl Watch {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Watch::Watching,
            2 => Watch::Covered,
            3 => Watch::Contended,
            _ => Watch::Off,
        }
    }
}

/// State shared between a relay run and its listener.
#[derive(Debug)]
pub(crate) struct Wake {
    /// Woken on every NOTIFY, (re)connect and change of [`Watch`].
    pub(crate) notify: Notify,
    listening: AtomicBool,
    /// Runs of the relay holding their LISTEN connection.
    relay_listening: Arc<AtomicUsize>,
    watch: AtomicU8,
    want_idle: watch::Sender<bool>,
}

impl Wake {
    pub(crate) fn new(relay_listening: Arc<AtomicUsize>) -> Self {
        Wake {
            notify: Notify::new(),
            listening: AtomicBool::new(false),
            relay_listening,
            watch: AtomicU8::new(Watch::Off as u8),
            want_idle: watch::channel(false).0,
        }
    }

    pub(crate) fn listening(&self) -> bool {
        self.listening.load(Ordering::SeqCst)
    }

    pub(crate) fn set_listening(&self, listening: bool) {
        if self.listening.swap(listening, Ordering::SeqCst) != listening {
            if listening {
                self.relay_listening.fetch_add(1, Ordering::SeqCst);
            } else {
                self.relay_listening.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }

    /// The relay has nothing to do (`true`: hold the wake lock) or has work (`false`: let
    /// it go, writers need not notify a busy relay).
    pub(crate) fn want_idle(&self, idle: bool) {
        self.want_idle.send_if_modified(|want| {
            let changed = *want != idle;
            *want = idle;
            changed
        });
    }

    pub(crate) fn watch(&self) -> Watch {
        Watch::from_u8(self.watch.load(Ordering::SeqCst))
    }

    fn set_watch(&self, watch: Watch) {
        if self.watch.swap(watch as u8, Ordering::SeqCst) != watch as u8 {
            self.notify.notify_one();
        }
    }
}

/// The listener's statements for one table.
#[derive(Debug, Clone)]
pub(crate) struct ListenerStatements {
    pub(crate) listen: String,
    pub(crate) watch: Sql<NoParams>,
    pub(crate) unwatch: Sql<NoParams>,
}

impl ListenerStatements {
    pub(crate) fn render(table: &TableName) -> Self {
        let wake_key = table.wake_lock_key();
        ListenerStatements {
            listen: format!("LISTEN \"{}\"", table.channel()),
            // Try to become the watcher, and if that fails, tell whether another relay is
            // (then writers notify) or writers hold it (then their commits must be looked
            // for).
            watch: Sql::new(format!(
                "SELECT pg_try_advisory_lock({wake_key}) AS got, EXISTS (\n\
                 \x20   SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2\n\
                 \x20   AND database = (SELECT oid FROM pg_database WHERE datname = current_database())\n\
                 \x20   AND classid = {WAKE_LOCK_CLASS}::oid AND objid = {key}::oid\n\
                 \x20   AND mode = 'ExclusiveLock' AND granted AND pid <> pg_backend_pid()\n\
                 ) AS watched",
                key = table.wake_lock_oid(),
            )),
            unwatch: Sql::new(format!("SELECT pg_advisory_unlock({wake_key}) AS released")),
        }
    }
}

/// Holds a LISTEN forever: on each notification wakes the relay; on loss reconnects with
/// capped exponential backoff, reset after every successful LISTEN. Each (re)connect wakes
/// the relay once, to catch up on notifications sent while nobody listened.
///
/// Its connects tell `vitals` whether the database answers: they fail at once when it does
/// not, where the relay's claims wait for the pool's connection timeout.
pub(crate) async fn run(
    pool: PgPool,
    sql: ListenerStatements,
    table: String,
    wake: Arc<Wake>,
    vitals: Arc<Vitals>,
) {
    let mut backoff = Backoff::new(RECONNECT_MIN, RECONNECT_MAX);
    let mut lost = Streak::default();
    loop {
        let failure = match pool.dedicated_connection().await {
            Ok(mut conn) => match conn.batch_execute(&sql.listen).await {
                Ok(()) => {
                    vitals.database(None);
                    wake.set_listening(true);
                    backoff.reset();
                    match lost.ended() {
                        Some(lost_for) => {
                            tracing::info!(table = %table, lost_for = ?lost_for, "relay listening for wake-ups again")
                        }
                        None => tracing::debug!(table = %table, "relay listening for wake-ups"),
                    }
                    wake.notify.notify_one();
                    let why = hold(&mut conn, &sql, &wake).await;
                    wake.set_listening(false);
                    wake.set_watch(Watch::Off);
                    wake.notify.notify_one();
                    why
                }
                Err(e) => format!("LISTEN failed: {e}"),
            },
            Err(e) => {
                vitals.database(Some(e.to_string()));
                format!("connecting failed: {e}")
            }
        };
        let delay = backoff.failed();
        match lost.failed() {
            Loudness::First => tracing::warn!(
                table = %table, error = %failure, retry_in = ?delay,
                "relay's LISTEN connection lost; polling until it is back"
            ),
            Loudness::Again(lost_for) => tracing::warn!(
                table = %table, error = %failure, lost_for = ?lost_for, retry_in = ?delay,
                "relay's LISTEN connection still lost; polling"
            ),
            Loudness::Quiet => tracing::debug!(
                table = %table, error = %failure, retry_in = ?delay,
                "relay's LISTEN connection: reconnecting failed"
            ),
        }
        tokio::time::sleep(delay).await;
    }
}

#[derive(QueryableByName)]
struct Tried {
    #[diesel(sql_type = Bool)]
    got: bool,
    #[diesel(sql_type = Bool)]
    watched: bool,
}

#[derive(QueryableByName)]
struct Released {
    #[diesel(sql_type = Bool)]
    #[allow(dead_code)] // read to run the statement
    released: bool,
}

/// Forwards notifications and keeps the wake lock as the relay wants, until the connection
/// fails; returns why.
async fn hold(conn: &mut AsyncPgConnection, sql: &ListenerStatements, wake: &Wake) -> String {
    // Here only: its `load` would shadow the atomics' own.
    use diesel_async::RunQueryDsl;
    let mut want_idle = wake.want_idle.subscribe();
    let mut holding = false;
    loop {
        let want = *want_idle.borrow_and_update();
        // How long to wait for notifications before looking at the lock again.
        let mut wait = HEALTH_CHECK;
        if want && !holding {
            // Bounded: a connection that died silently must not leave the relay thinking it
            // is covered by another relay's wake lock.
            let tried = answered(
                "taking the wake lock",
                sql.watch.bind(NoParams {}).get_result::<Tried>(conn),
            );
            match tried.await {
                Ok(tried) if tried.got => {
                    holding = true;
                    wake.set_watch(Watch::Watching);
                }
                Ok(tried) if tried.watched => {
                    wake.set_watch(Watch::Covered);
                    wait = COVERED_RETRY;
                }
                Ok(_) => {
                    wake.set_watch(Watch::Contended);
                    wait = WATCH_RETRY;
                }
                Err(why) => return why,
            }
        } else if !want && holding {
            let released = answered(
                "releasing the wake lock",
                sql.unwatch.bind(NoParams {}).get_result::<Released>(conn),
            );
            if let Err(why) = released.await {
                return why;
            }
            holding = false;
            wake.set_watch(Watch::Off);
        } else if !want {
            wake.set_watch(Watch::Off);
        }
        let mut timed_out = false;
        {
            let mut stream = pin!(conn.notifications_stream());
            let timer = tokio::time::sleep(wait);
            let mut timer = pin!(timer);
            loop {
                tokio::select! {
                    item = stream.next() => match item {
                        Some(Ok(_)) => wake.notify.notify_one(),
                        Some(Err(e)) => return format!("notification stream failed: {e}"),
                        None => return "notification stream ended".to_owned(),
                    },
                    changed = want_idle.changed() => {
                        if changed.is_err() {
                            return "the relay stopped".to_owned();
                        }
                        break;
                    }
                    () = &mut timer => {
                        timed_out = true;
                        break;
                    }
                }
            }
        }
        if timed_out && wait == HEALTH_CHECK {
            // Notifications that arrive meanwhile are buffered by the connection.
            if let Err(why) = answered("health check", conn.batch_execute("SELECT 1")).await {
                return why;
            }
        }
    }
}

/// `query`'s result within [`HEALTH_CHECK_TIMEOUT`], or why not (naming `what`).
async fn answered<T, E: std::fmt::Display>(
    what: &str,
    query: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(HEALTH_CHECK_TIMEOUT, query).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(format!("{what} failed: {e}")),
        Err(_) => Err(format!("{what} got no answer")),
    }
}

#[cfg(test)]
impl crate::sql::Listed for ListenerStatements {
    fn listed(&self) -> Vec<(String, &str)> {
        let ListenerStatements {
            listen,
            watch,
            unwatch,
        } = self;
        vec![
            watch.named("watch"),
            unwatch.named("unwatch"),
            ("listen".into(), listen.as_str()),
        ]
    }
}
