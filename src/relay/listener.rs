//! Wake-up: LISTEN on a dedicated connection, reconnecting with backoff.

use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use futures_util::StreamExt;
use tokio::sync::Notify;

use super::PgPool;

const RECONNECT_MIN: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(30);
/// A silently dead connection delivers nothing; a round trip this often finds out.
const HEALTH_CHECK: Duration = Duration::from_secs(15);

/// State shared between a relay run and its listener.
#[derive(Debug)]
pub(crate) struct Wake {
    pub(crate) notify: Notify,
    listening: AtomicBool,
    /// Runs of the relay holding their LISTEN connection.
    relay_listening: Arc<AtomicUsize>,
}

impl Wake {
    pub(crate) fn new(relay_listening: Arc<AtomicUsize>) -> Self {
        Wake {
            notify: Notify::new(),
            listening: AtomicBool::new(false),
            relay_listening,
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
}

/// Holds a LISTEN forever: on each notification wakes the relay; on loss reconnects with
/// capped exponential backoff, reset after every successful LISTEN. Each (re)connect wakes
/// the relay once, to catch up on notifications sent while nobody listened.
pub(crate) async fn run(pool: PgPool, listen_sql: String, table: String, wake: Arc<Wake>) {
    let mut delay = RECONNECT_MIN;
    loop {
        let failure = match pool.dedicated_connection().await {
            Ok(mut conn) => match conn.batch_execute(&listen_sql).await {
                Ok(()) => {
                    wake.set_listening(true);
                    delay = RECONNECT_MIN;
                    tracing::debug!(table = %table, "relay listening for wake-ups");
                    wake.notify.notify_one();
                    let why = hold(&mut conn, &wake).await;
                    wake.set_listening(false);
                    why
                }
                Err(e) => format!("LISTEN failed: {e}"),
            },
            Err(e) => format!("connecting failed: {e}"),
        };
        tracing::warn!(
            table = %table,
            error = %failure,
            retry_in = ?delay,
            "relay's LISTEN connection lost; polling until it is back"
        );
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(RECONNECT_MAX);
    }
}

/// Forwards notifications until the connection fails; returns why.
async fn hold(conn: &mut AsyncPgConnection, wake: &Wake) -> String {
    loop {
        {
            let mut stream = pin!(conn.notifications_stream());
            let health_check = tokio::time::sleep(HEALTH_CHECK);
            let mut health_check = pin!(health_check);
            loop {
                tokio::select! {
                    item = stream.next() => match item {
                        Some(Ok(_)) => wake.notify.notify_one(),
                        Some(Err(e)) => return format!("notification stream failed: {e}"),
                        None => return "notification stream ended".to_owned(),
                    },
                    () = &mut health_check => break,
                }
            }
        }
        // Notifications that arrive meanwhile are buffered by the connection.
        if let Err(e) = conn.batch_execute("SELECT 1").await {
            return format!("health check failed: {e}");
        }
    }
}
