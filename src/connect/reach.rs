//! Start-up that meets a database restart or outage: the first steps of a relay or a
//! consumer tried again for a bounded time ([`until_reachable`]), and what counts as a
//! failure a retry may mend ([`Error::is_connection`]).

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::{Error, Result};

/// The first wait between tries, doubled after each failed one up to [`MAX_DELAY`].
const FIRST_DELAY: Duration = Duration::from_millis(250);
/// The longest wait between tries.
const MAX_DELAY: Duration = Duration::from_secs(2);
/// The least time a try is given, however little of the timeout is left.
const MIN_TRY: Duration = Duration::from_secs(1);

/// Runs `attempt` until it succeeds, until it fails with an error that is not a connection
/// failure ([`Error::is_connection`]: that error is returned at once), or until `timeout`
/// has passed since the first try. Each failed try is logged (warn, with `what`, the try's
/// number and its cause) and followed by a wait of 250 ms, doubled after each try up to
/// 2 s, which never runs past the timeout. A try still running when the timeout ends is
/// cut off (it gets at least a second). A `timeout` of zero tries once, for as long as it
/// takes.
///
/// A relay or a consumer starting while PostgreSQL restarts (or before it is up) meets
/// connections refused, "the database system is starting up" and "terminating connection
/// due to administrator command"; this rides them out and still fails on a refused login,
/// a database that does not exist or a missing table.
///
/// ```no_run
/// use std::time::Duration;
/// use diesel_outbox::{Outbox, PgPool, checkout, until_reachable};
///
/// # async fn run(outbox: Outbox, pool: PgPool) -> Result<(), diesel_outbox::Error> {
/// let stats = until_reachable("start-up", Duration::from_secs(30), || async {
///     let mut conn = checkout(&pool).await?;
///     outbox.stats(&mut conn).await
/// })
/// .await?;
/// # let _ = stats; Ok(()) }
/// ```
///
/// # Errors
/// The first error that is not a connection failure; when the timeout ends,
/// [`Error::Pool`] saying how many tries were made over how long, with the last one's
/// cause.
pub async fn until_reachable<T, F, Fut>(what: &str, timeout: Duration, mut attempt: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let started = Instant::now();
    let mut delay = FIRST_DELAY;
    for tries in 1u32.. {
        // A try that hangs (a pool waiting out its own connection timeout, a server that
        // does not answer) ends with the time left, though never under a second.
        let left = timeout.saturating_sub(started.elapsed());
        let outcome = if timeout.is_zero() {
            attempt().await
        } else {
            let bound = left.max(MIN_TRY);
            tokio::time::timeout(bound, attempt())
                .await
                .unwrap_or_else(|_| {
                    Err(Error::Pool(format!("no answer within {bound:.1?}").into()))
                })
        };
        let err = match outcome {
            Ok(value) => {
                if tries > 1 {
                    tracing::info!(what, tries, waited = ?started.elapsed(), "the database answers");
                }
                return Ok(value);
            }
            Err(e) if !e.is_connection() => return Err(e),
            Err(e) => e,
        };
        let left = timeout.saturating_sub(started.elapsed());
        if left.is_zero() {
            let cause = match &err {
                Error::Pool(cause) => cause.to_string(),
                err => err.to_string(),
            };
            return Err(Error::Pool(
                format!(
                    "the database could not be reached in {tries} {} over {:.1?} \
                     (the connect timeout is {timeout:?}): {cause}",
                    if tries == 1 { "try" } else { "tries" },
                    started.elapsed()
                )
                .into(),
            ));
        }
        let wait = delay.min(left);
        tracing::warn!(
            what, tries, error = %err, retry_in = ?wait, gives_up_in = ?left,
            "the database cannot be reached yet; trying again"
        );
        tokio::time::sleep(wait).await;
        delay = (delay * 2).min(MAX_DELAY);
    }
    unreachable!("the tries run until one returns")
}

/// Whether a connection failure's text names a cause no retry mends: a refused login, a
/// database or role that does not exist, no `pg_hba.conf` entry, a certificate that does
/// not verify (what [`establish`](crate::establish) reports), or a URL it could not read.
pub(crate) fn permanent(message: &str) -> bool {
    const CAUSES: [&str; 7] = [
        "authentication failed",
        "does not exist",
        "no pg_hba.conf entry",
        "certificate verification failed",
        "does not support TLS",
        "malformed",
        "invalid connection",
    ];
    CAUSES.iter().any(|cause| message.contains(cause))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    fn refused() -> Error {
        Error::Pool("cannot connect to 127.0.0.1:1: connection refused".into())
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_failure_is_tried_again_until_it_clears() {
        let tries = AtomicU32::new(0);
        let got = until_reachable("test", Duration::from_secs(30), || async {
            if tries.fetch_add(1, Ordering::SeqCst) < 3 {
                Err(refused())
            } else {
                Ok(7)
            }
        })
        .await
        .unwrap();
        assert_eq!((got, tries.load(Ordering::SeqCst)), (7, 4));
    }

    #[tokio::test(start_paused = true)]
    async fn the_timeout_ends_the_tries_and_says_how_many() {
        let tries = AtomicU32::new(0);
        let started = tokio::time::Instant::now();
        let err = until_reachable("test", Duration::from_secs(5), || async {
            tries.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(refused())
        })
        .await
        .unwrap_err();
        let message = err.to_string();
        assert!(matches!(err, Error::Pool(_)), "{err:?}");
        assert!(message.contains("connection refused"), "{message}");
        // 0.25 + 0.5 + 1 + 2 = 3.75 s, then the 1.25 s left: six tries, and no wait past 5 s.
        assert_eq!(tries.load(Ordering::SeqCst), 6, "{message}");
        assert!(message.contains("in 6 tries"), "{message}");
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_try_that_hangs_ends_with_the_timeout() {
        let started = tokio::time::Instant::now();
        let err = until_reachable("test", Duration::from_secs(5), || {
            std::future::pending::<Result<()>>()
        })
        .await
        .unwrap_err();
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        let message = err.to_string();
        assert!(message.contains("in 1 try over"), "{message}");
        assert!(message.ends_with("no answer within 5.0s"), "{message}");
    }

    #[tokio::test(start_paused = true)]
    async fn what_no_retry_mends_fails_at_once() {
        for err in [
            Error::Pool("cannot connect to db:5432: password authentication failed".into()),
            Error::Pool("cannot connect to db:5432: database \"nope\" does not exist".into()),
            Error::NotMigrated {
                table: "outbox".into(),
            },
        ] {
            let shown = err.to_string();
            let tries = AtomicU32::new(0);
            let mut once = Some(err);
            let got = until_reachable("test", Duration::from_secs(30), || {
                tries.fetch_add(1, Ordering::SeqCst);
                let err = once.take().expect("tried once");
                async move { Err::<(), _>(err) }
            })
            .await
            .unwrap_err();
            assert_eq!(got.to_string(), shown);
            assert_eq!(tries.load(Ordering::SeqCst), 1, "{shown}");
        }
    }

    #[test]
    fn a_restart_is_a_connection_failure_and_a_statement_error_is_not() {
        use diesel::result::{DatabaseErrorKind, Error as DieselError};
        let db = |kind, message: &str| {
            Error::Database(DieselError::DatabaseError(
                kind,
                Box::new(message.to_owned()),
            ))
        };
        assert!(
            db(
                DatabaseErrorKind::Unknown,
                "terminating connection due to administrator command"
            )
            .is_connection()
        );
        assert!(
            db(
                DatabaseErrorKind::Unknown,
                "the database system is starting up"
            )
            .is_connection()
        );
        assert!(db(DatabaseErrorKind::ClosedConnection, "closed").is_connection());
        assert!(!db(DatabaseErrorKind::Unknown, "syntax error at or near \"x\"").is_connection());
        assert!(
            !db(
                DatabaseErrorKind::Unknown,
                "canceling statement due to statement timeout"
            )
            .is_connection()
        );
        assert!(refused().is_connection());
        assert!(!Error::InvalidOption("x".into()).is_connection());
    }
}
